"""``python -m epkit.run``, also under ``torchrun --nproc-per-node N -m epkit.run``: the reference model as a
command (:func:`epkit.model.run.main`; ``epkit run`` is the same)."""

from epkit.model.run import end_process, main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(end_process(main()))
