"""``python -m epkit.run``, also under ``torchrun --nproc-per-node N -m epkit.run``: the reference model as a
command (:func:`epkit.model.run.main`; ``epkit run`` is the same)."""

from epkit.model.run import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
