"""What lets an engine's own installed modules run on CPU ranks over ``epkit.compat.deep_ep``: the skip that names
the install command, the ``deep_ep`` binding and the stand-ins for what a CPU install of the engine cannot import.

Nothing here edits an engine's files or epkit's: each stand-in is applied in the rank's process at run time, and
each test module's docstring lists the ones it uses.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

import pytest

#: The install the skips name (tests/engines/README.md has it with its sizes and times).
INSTALL = "see tests/engines/README.md: bash tests/engines/install.sh (a separate venv, /work/engines-venv by default)"


def require(module: str) -> None:
    """Skip the calling test module unless the engine's ``module`` is importable, naming the install command."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed; {INSTALL}", allow_module_level=True)


def bind_deep_ep() -> None:
    """``import deep_ep`` gives ``epkit.compat.deep_ep`` (the engines import DeepEP under that name)."""
    import epkit.compat.deep_ep

    sys.modules["deep_ep"] = epkit.compat.deep_ep


class _Anything:
    """An attribute, call or subscript of the torchvision stand-in: a placeholder that is never used for a value."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()

    def __call__(self, *args, **kwargs):
        return _Anything()

    def __getitem__(self, key):
        return _Anything()

    def __mro_entries__(self, bases):
        return (object,)


class _TorchvisionStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``torchvision`` and its submodules as empty modules of version 0.0.0 (see :func:`stand_in_torchvision`)."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0"

        def attribute(name: str):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Anything()

        module.__getattr__ = attribute
        return module

    def exec_module(self, module):
        pass


def stand_in_torchvision() -> None:
    """Patch: SGLang's multimodal modules import torchvision when ``sglang.srt.configs`` loads, and the index's
    torchvision is a CUDA build (its ops need ``libtorch_cuda.so``), so it cannot load beside CPU torch. The MoE
    dispatchers never call it: an empty stand-in (version 0.0.0, so transformers' version checks say "older")
    lets the import chain finish."""
    if importlib.util.find_spec("torchvision") is None:
        sys.meta_path.insert(0, _TorchvisionStandIn())


def perturb_combine(factor: float = 1.01) -> None:
    """The negative control: the shim's V2 combine scales its output by ``factor`` (in this rank's process), so a
    comparison that cannot tell must fail. 1.01, not less: a 0.1% change mostly rounds back to the same bf16."""
    import epkit.compat.deep_ep as shim

    combine = shim.ElasticBuffer.combine

    def scaled(self, *args, **kwargs):
        x, weights, event = combine(self, *args, **kwargs)
        return x * factor, weights, event

    shim.ElasticBuffer.combine = scaled
