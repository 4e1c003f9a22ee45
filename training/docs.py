"""Regenerate the generated parts of README.md: the configuration reference (from the schema) and
the plan of the 3B config (``train_xla.py configs/nash_mhc_3b.yaml --plan --device-kind v4``).

    python -m training.docs          # rewrite the blocks between the markers
    python -m training.docs --check  # exit 1 if README.md is stale (the test suite checks this too)
"""
import argparse
import io
import sys
from pathlib import Path

from .config import schema_markdown

BEGIN, END = "<!-- config-reference:begin -->", "<!-- config-reference:end -->"
PLAN_BEGIN, PLAN_END = "<!-- plan-3b:begin -->", "<!-- plan-3b:end -->"
PLAN_ARGS = ["configs/nash_mhc_3b.yaml", "--plan", "--device-kind", "v4"]
ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def plan_block() -> str:
    """The 3B plan as README shows it: the command and its output."""
    from .config import load_config
    from .plan import run_plan

    out = io.StringIO()
    cfg = load_config(ROOT / PLAN_ARGS[0])
    run_plan(cfg, "xla", PLAN_ARGS[0], PLAN_ARGS[3], 0.4, None, None, 0.1, out=out)
    return f"```\n$ python train_xla.py {' '.join(PLAN_ARGS)}\n{out.getvalue().rstrip()}\n```\n"


def _replace(text: str, begin: str, end: str, body: str) -> str:
    if begin not in text or end not in text:
        raise SystemExit(f"{README}: markers {begin} ... {end} not found")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body}{end}{tail}"


def render(text: str, plan: bool = True) -> str:
    text = _replace(text, BEGIN, END, schema_markdown())
    return _replace(text, PLAN_BEGIN, PLAN_END, plan_block()) if plan else text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.docs",
                                     description="Regenerate README.md's config and plan blocks.")
    parser.add_argument("--check", action="store_true", help="only say whether they are up to date")
    args = parser.parse_args(argv)
    text = README.read_text()
    new = render(text)
    if args.check:
        if new != text:
            print(f"{README} is stale: run python -m training.docs", file=sys.stderr)
            return 1
        print(f"{README}: the config reference and the 3B plan are up to date")
        return 0
    if new != text:
        README.write_text(new)
        print(f"updated {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
