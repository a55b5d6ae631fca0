"""Run every bench/<name>.py that has a `main()`, or the named ones.

python -m bench                          # all
python -m bench engine_faithfulness      # one
python -m bench engine_throughput -- --duration 5   # flags after -- go to main(argv)
python -m bench actuation -- --no-live   # cold start vs sleep/wake, modelled only
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
import time

import bench


def _benchmarks() -> dict[str, object]:
    found = {}
    for info in sorted(pkgutil.iter_modules(bench.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"bench.{info.name}")
        main = getattr(module, "main", None)
        if callable(main):
            found[info.name] = main
    return found


def _call(main: object, argv: list[str]) -> int:
    assert callable(main)
    takes_argv = bool(inspect.signature(main).parameters)
    rc = main(argv) if takes_argv else main()
    return int(rc or 0)


def run(argv: list[str]) -> int:
    names, extra = argv, []
    if "--" in argv:
        i = argv.index("--")
        names, extra = argv[:i], argv[i + 1 :]
    available = _benchmarks()
    unknown = [n for n in names if n not in available]
    if unknown:
        print(f"unknown benchmark(s): {', '.join(unknown)}; known: {', '.join(available)}")
        return 2
    failed = []
    for name in names or list(available):
        print(f"== {name}", flush=True)
        t0 = time.monotonic()
        rc = _call(available[name], extra)
        verdict = "ok" if rc == 0 else f"FAILED (exit {rc})"
        print(f"== {name}: {verdict} in {time.monotonic() - t0:.0f} s")
        if rc:
            failed.append(name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
