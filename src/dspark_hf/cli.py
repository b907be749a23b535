"""The `dspark-hf` command: thin subcommands over library functions.

    dspark-hf demo        speculative vs target-only generation, side by side (see dspark_hf.demo)
    dspark-hf bench       throughput vs concurrency per verification policy (see dspark_hf.bench.throughput)
    dspark-hf bench-head  cost of the sequential head vs the parallel forward (see dspark_hf.bench.head_cost)
"""

from __future__ import annotations

import sys
from typing import Callable


def _demo(argv: list[str]) -> None:
    from .demo import main

    main(argv)


def _bench(argv: list[str]) -> None:
    from .bench.throughput import main

    main(argv)


def _bench_head(argv: list[str]) -> None:
    from .bench.head_cost import main

    main(argv)


COMMANDS: dict[str, tuple[Callable[[list[str]], None], str]] = {
    "demo": (_demo, "speculative vs target-only generation, side by side"),
    "bench": (_bench, "throughput vs concurrency for every verification policy"),
    "bench-head": (_bench_head, "time the sequential head against the parallel forward"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: dspark-hf COMMAND [options]\n\ncommands:")
        for name, (_, help_text) in COMMANDS.items():
            print(f"  {name:<12} {help_text}")
        print("\n`dspark-hf COMMAND --help` for a command's options.")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"dspark-hf: unknown command {name!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    import dspark_hf  # noqa: F401  (registers the generate() hook and Auto classes)

    COMMANDS[name][0](rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
