"""Record an engine's own command-line table as data (tests/data/<engine>_serve_args-<ver>.json).

    python -m bench._engine_args_table vllm   > tests/data/vllm_serve_args-0.34.0.json
    python -m bench._engine_args_table sglang > tests/data/sglang_launch_server_args-0.5.23.json

It builds the engine's real argument parser (vLLM: `vllm serve`'s `make_arg_parser`; SGLang:
`ServerArgs.add_cli_args`, what `python -m sglang.launch_server` parses) and writes every
option: its spellings, whether it takes a value, its choices. The engine must be importable.
Where it is not installed with its GPU stack (no torch here), put its wheel's sources on the
path and pass `--stub-missing`: any module that cannot be imported becomes an empty stand-in,
which is enough to build a parser (the tables in tests/data were made this way):

    pip download vllm==0.34.0 --no-deps -d /tmp/w && unzip -q /tmp/w/vllm-*.whl 'vllm/*' -d /tmp/src
    PYTHONPATH=/tmp/src python -m bench._engine_args_table vllm --stub-missing --version 0.34.0

vLLM's environment variables (`vllm/envs.py`) and quantization methods are recorded beside the
flags: the launch tests check every variable and `--quantization` value flexpipe emits.
"""

from __future__ import annotations

import abc
import argparse
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import re
import sys
import types
from collections.abc import Sequence
from typing import Any

# torch's namespaces for other accelerators: a stand-in torch has none (engines probe them
# with hasattr and then insist the device is there)
_ABSENT_BACKENDS = frozenset({"npu", "hpu", "xpu", "musa", "mlu", "mps"})


class _Anything(types.ModuleType):
    """A stand-in module: every attribute is a further stand-in, callable and subclassable."""

    __version__ = "0"

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__path__: list[str] = []  # a package: its submodules are stand-ins too

    def __getattr__(self, name: str) -> Any:
        if (name.startswith("__") and name.endswith("__")) or name in _ABSENT_BACKENDS:
            raise AttributeError(name)
        return _stand_in(f"{self.__name__}.{name}")


def _stand_in(qualname: str) -> Any:
    class Meta(abc.ABCMeta):  # (engine classes mix stand-ins with ABC)
        def __getattr__(cls, name: str) -> Any:
            if name.startswith("__") and name.endswith("__"):
                raise AttributeError(name)
            return _stand_in(f"{qualname}.{name}")

        def __call__(cls, *args: Any, **kwargs: Any) -> Any:
            if "_stand_in" in cls.__dict__:
                return cls
            return super().__call__(*args, **kwargs)  # a real class built on a stand-in

        def __getitem__(cls, item: Any) -> Any:
            return cls

        def __setitem__(cls, key: Any, value: Any) -> None:
            return None

        def __iter__(cls) -> Any:
            return iter((cls, cls))  # (a device capability: major, minor)

        def __or__(cls, other: Any) -> Any:
            return cls

        def __eq__(cls, other: object) -> bool:  # import-time sanity checks pass
            return True

        def __hash__(cls) -> int:
            return id(cls)

        def __len__(cls) -> int:
            return 0

        def __int__(cls) -> int:
            return 0

        def __index__(cls) -> int:
            return 0

        def __ge__(cls, other: Any) -> bool:
            return True

        def __le__(cls, other: Any) -> bool:
            return True

        def __gt__(cls, other: Any) -> bool:
            return False

        def __lt__(cls, other: Any) -> bool:
            return False

        def __add__(cls, other: Any) -> Any:
            return cls

        __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __add__
        __and__ = __rand__ = __add__

        def __ror__(cls, other: Any) -> Any:
            return cls

    def any_schema(cls: Any, source: Any, handler: Any) -> Any:
        from pydantic_core import core_schema  # (pydantic models may name a stand-in type)

        return core_schema.any_schema()

    namespace = {
        "__module__": qualname,
        "_stand_in": True,
        "__get_pydantic_core_schema__": classmethod(any_schema),
    }
    return Meta(qualname.rsplit(".", 1)[-1], (), namespace)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of modules outside `keep` that the real finders cannot find become stand-ins."""

    def __init__(self, keep: str) -> None:
        self.keep = keep

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        top = fullname.split(".")[0]
        if top == self.keep or top in sys.stdlib_module_names:
            return None  # (the standard library's absent modules are meant to stay absent)
        if top in sys.modules and not isinstance(sys.modules[top], _Anything):
            return None  # a real package: its absent parts stay absent
        if fullname == top and importlib.machinery.PathFinder.find_spec(top) is not None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: Any) -> types.ModuleType:
        return _Anything(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def _stub_missing(keep: str) -> None:
    """Stand-ins for absent modules, and version "0" for absent distributions (the engine
    asks torch's version at import)."""
    import importlib.metadata as metadata

    real_version = metadata.version

    def version(distribution_name: str) -> str:
        try:
            return real_version(distribution_name)
        except metadata.PackageNotFoundError:
            return "0"

    metadata.version = version
    sys.meta_path.append(_StubFinder(keep))


def _vllm_parser() -> argparse.ArgumentParser:
    utils = importlib.import_module("vllm.utils.argparse_utils")
    cli = importlib.import_module("vllm.entrypoints.common.cli_args")
    parser: argparse.ArgumentParser = cli.make_arg_parser(utils.FlexibleArgumentParser())
    return parser


def _sglang_parser() -> argparse.ArgumentParser:
    server_args = importlib.import_module("sglang.srt.server_args")
    parser = argparse.ArgumentParser()
    server_args.ServerArgs.add_cli_args(parser)
    return parser


def _takes_value(action: argparse.Action) -> bool | str:
    """True: needs a value; False: a switch; "optional": may have one (nargs='?')."""
    if action.nargs == 0:
        return False
    if action.nargs == "?":
        return "optional"
    return True


def _choices(action: argparse.Action) -> list[str] | None:
    if action.choices is None:
        return None
    return sorted(str(c) for c in action.choices if c is not None)


def _known_values(action: argparse.Action) -> list[str] | None:
    """Values an open option lists without enforcing them (vLLM puts a `Literal | str`
    field's values in its metavar: `--kv-cache-dtype`, `--quantization`)."""
    if isinstance(action.metavar, list | tuple):
        return sorted(str(v) for v in action.metavar)
    return None


def option_table(parser: argparse.ArgumentParser) -> dict[str, dict[str, Any]]:
    """Every spelling the parser accepts (hidden ones included) -> {"dest", "takes_value",
    "choices", "known_values"}; positionals under their dest with "positional": true."""
    table: dict[str, dict[str, Any]] = {}

    def entry(action: argparse.Action) -> dict[str, Any]:
        return {
            "dest": action.dest,
            "takes_value": _takes_value(action),
            "choices": _choices(action),
            "known_values": _known_values(action),
        }

    for action in parser._actions:
        if not action.option_strings and not isinstance(action, argparse._HelpAction):
            table[action.dest] = {**entry(action), "positional": True}
    for spelling, action in parser._option_string_actions.items():
        if not isinstance(action, argparse._HelpAction):
            table[spelling] = entry(action)
    return dict(sorted(table.items()))


def _metric_names(module: str, prefix: str) -> list[str]:
    """The Prometheus metric names a module defines (`name="vllm:..."`), read from its source
    (the metrics are made at run time, by objects this script does not build)."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    with open(spec.origin, encoding="utf-8") as f:
        source = f.read()
    return sorted(set(re.findall(rf'"({re.escape(prefix)}:[a-z0-9_]+)"', source)))


def _vllm_extras() -> dict[str, Any]:
    envs = importlib.import_module("vllm.envs")
    quant = importlib.import_module("vllm.model_executor.layers.quantization")
    return {
        "env": sorted(envs.environment_variables),
        "quantization_methods": sorted(quant.QUANTIZATION_METHODS),
        "metrics": _metric_names("vllm.v1.metrics.loggers", "vllm"),
    }


def _sglang_extras() -> dict[str, Any]:
    return {"metrics": _metric_names("sglang.srt.observability.metrics_collector", "sglang")}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench._engine_args_table", description=__doc__)
    ap.add_argument("engine", choices=("vllm", "sglang"))
    ap.add_argument("--stub-missing", action="store_true", help="stand-ins for absent modules")
    ap.add_argument("--version", default=None, help="the release the sources are from")
    args = ap.parse_args(argv)
    if args.stub_missing:
        _stub_missing(args.engine)
        # no GPU stack: the engine's CPU platform (its option table is the same)
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    if args.engine == "vllm":
        parser, command = _vllm_parser(), "vllm serve"
        extras = _vllm_extras()
    else:
        parser, command = _sglang_parser(), "python -m sglang.launch_server"
        extras = _sglang_extras()
    doc = {
        "engine": args.engine,
        "version": args.version,
        "command": command,
        "made_by": "python -m bench._engine_args_table (bench/_engine_args_table.py)",
        "options": option_table(parser),
        **extras,
    }
    json.dump(doc, sys.stdout, indent=1, sort_keys=False)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
