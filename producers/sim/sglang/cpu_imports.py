"""Import-time stand-ins that let SGLang 0.5.23's scheduler modules import on a CPU-only machine.

Used only inside the subprocess that drives SGLang's own classes for the conformance check
(``producers.sim.sglang.reference``); never in kvguard's own process, never installed into a venv.

Three packages are not installed there, and SGLang names them at import time only, on paths the
driven code never calls:

- ``triton`` (about 1 GB installed): ``sglang/srt/utils/common.py`` imports it at top level, and
  ~115 kernels across ``mem_cache``, ``layers`` and ``kernels`` are decorated ``@triton.jit`` /
  ``@triton.autotune`` at import (with ``triton.Config`` lists, ``tl.constexpr`` / ``tl.tensor``
  annotations, ``tl.uint32``-style dtype constants and ``triton.language.extra.libdevice``). On CPU SGLang launches none of them:
  ``current_platform.capabilities.supports_triton`` is False, so the paged allocator runs
  ``alloc_extend_naive`` / ``alloc_decode_naive`` and the req-to-token writes take their torch path.
  A stub kernel raises ``RuntimeError`` when launched or called, so a driven path that did reach one
  would fail the check instead of running something fake.
- ``torchvision``: the PyPI wheel is a CUDA build that fails to load next to the CPU torch
  (``operator torchvision::nms does not exist``); ``sglang/srt/configs`` (the model-config registry,
  via ``nano_nemotron_vl`` -> ``multimodal/internvl_utils``) imports a few names from it. Stand-ins
  are inert placeholders that raise when called; the stand-in says it is version 0.0.0, so
  transformers (which then sees a torchvision) picks its paths for an old one, import-time only.
- ``IPython``: ``sglang/utils.py`` imports ``IPython.display.HTML, display`` for notebook output.

Torch must not mistake the ``triton`` stand-in for Triton: ``install()`` first imports the torch
modules that probe for Triton at import time (``torch.utils._triton``, ``torch._dynamo``,
``torch._inductor.runtime.triton_compat`` / ``hints``, ``torch.utils.flop_counter``,
``functorch.compile``), while Triton is really absent, so they record its absence; it refuses to
run when Triton is installed (then nothing needs standing in).
"""

from __future__ import annotations

import enum
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types


class StubKernel:
    """What ``@triton.jit`` / ``@triton.autotune`` return here: a kernel that cannot run."""

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = getattr(fn, "__doc__", None)

    def __getitem__(self, grid):
        raise RuntimeError(f"triton stand-in: kernel {self.__name__} was launched (the CPU path should not)")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"triton stand-in: kernel {self.__name__} was called (the CPU path should not)")


def _jit(fn=None, **_options):
    if fn is None:
        return StubKernel
    return StubKernel(fn)


def _decorator(*_args, **_kwargs):
    return lambda fn: fn if isinstance(fn, StubKernel) else StubKernel(fn)


class _Config:
    def __init__(self, kwargs=None, **options):
        self.kwargs, self.options = kwargs or {}, options


class _Constexpr:
    def __init__(self, value=None):
        self.value = value


class _Inert:
    """A namespace whose every attribute use raises (``libdevice`` functions, used inside kernels only)."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise RuntimeError(f"triton stand-in: {self._name}.{attr} used outside a kernel")


class _Placeholder:
    """A torchvision name: constructible (module-level defaults), never usable."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        raise RuntimeError("torchvision stand-in: not available on this CPU-only check")

    def __class_getitem__(cls, item):
        return cls


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    module.__path__ = []
    module.__kvguard_stand_in__ = True
    return module


def _torchvision_module(name: str) -> types.ModuleType:
    module = _module(name, __version__="0.0.0+kvguard-stand-in")

    def names(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return InterpolationMode if attr == "InterpolationMode" else type(attr, (_Placeholder,), {})

    module.__getattr__ = names
    return module


# dtype constants kernels' module-level code names (``tl.uint32`` in annotations and constants)
_TL_DTYPES = ("int1", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "bfloat16",
              "float32", "float64", "float8e4nv", "float8e5", "float8e4b15")


def _triton_modules() -> dict[str, types.ModuleType]:
    extra = _module("triton.language.extra", libdevice=_Inert("libdevice"))
    dtypes = {name: _Placeholder() for name in _TL_DTYPES}
    language = _module("triton.language", constexpr=_Constexpr, dtype=_Placeholder, tensor=_Placeholder, extra=extra,
                       **dtypes)
    triton = _module("triton", __version__="0.0.0+kvguard-stand-in", jit=_jit, autotune=_decorator,
                     heuristics=_decorator, Config=_Config, language=language, cdiv=lambda a, b: -(-a // b))
    return {"triton": triton, "triton.language": language, "triton.language.extra": extra}


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, modules: dict[str, types.ModuleType]):
        self.modules = modules

    def find_spec(self, fullname, path=None, target=None):
        if fullname in self.modules or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        if spec.name not in self.modules:
            self.modules[spec.name] = _torchvision_module(spec.name)
        return self.modules[spec.name]

    def exec_module(self, module):
        pass


# torch modules that look for Triton when imported; imported before the stand-in exists
_TORCH_PROBES = ("torch.utils._triton", "torch._dynamo", "torch._inductor.runtime.triton_compat",
                 "torch._inductor.runtime.hints", "torch.utils.flop_counter", "functorch.compile")


def install() -> list[str]:
    """Put the stand-ins on ``sys.meta_path`` (idempotent); the names stood in for."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return sorted(next(f for f in sys.meta_path if isinstance(f, _Finder)).modules)
    for name in ("triton", "torchvision", "IPython"):
        if name not in sys.modules and importlib.util.find_spec(name) is not None:
            raise RuntimeError(f"{name} is installed: run SGLang with it, not with kvguard's stand-in")
    for probe in _TORCH_PROBES:
        importlib.import_module(probe)
    # torch is imported by the probes above, before the stand-in exists (the point of the order)
    from torch.utils._triton import has_triton_package

    if has_triton_package():
        raise RuntimeError("torch found a Triton package although none is installed")
    modules = _triton_modules()
    modules["torchvision"] = _torchvision_module("torchvision")
    modules["IPython"] = _module("IPython")
    modules["IPython.display"] = _module("IPython.display", HTML=_Placeholder, display=_Placeholder)
    sys.meta_path.insert(0, _Finder(modules))
    return sorted(modules)
