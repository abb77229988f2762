"""Stubs for the vLLM names the shim does not map.

A stub can be imported, read (``KVQuantMode.NONE`` is another stub) and tested with
isinstance (never true); calling one raises NotMapped, which the run reports as "not
runnable: <name>". ``StubFinder`` makes every vLLM module the shim lacks a package of
stubs, so a test file's imports never fail on their own.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery


class NotMapped(Exception):
    """A vLLM name or call shape that kvpool does not have: the test cannot run against kvpool."""


class UnmappedMeta(type):
    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return stub(cls.__qualname__, name)

    def __call__(cls, *args, **kwargs):
        raise NotMapped(cls.__qualname__)


def stub(module: str, name: str) -> type:
    return UnmappedMeta(name, (), {"__qualname__": f"{module}.{name}", "__module__": module})


def module_getattr(module: str):
    """A module ``__getattr__`` that answers every missing public name with a stub."""

    def getattr_(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return stub(module, name)

    return getattr_


def refuse(what: str):
    raise NotMapped(what)


class StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on sys.meta_path: any ``vllm.*`` module not found in the shim is a stub package."""

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] != "vllm":
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        module.__path__ = []
        module.__getattr__ = module_getattr(module.__name__)
