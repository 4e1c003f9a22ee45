"""Regenerate the configuration reference in README.md from the schema.

    python -m training.docs          # rewrite the block between the markers
    python -m training.docs --check  # exit 1 if README.md is stale (the test suite checks this too)
"""
import sys
from pathlib import Path

from .config import schema_markdown

BEGIN, END = "<!-- config-reference:begin -->", "<!-- config-reference:end -->"
README = Path(__file__).resolve().parents[1] / "README.md"


def render(text: str) -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{README}: markers {BEGIN} ... {END} not found")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{schema_markdown()}{END}{tail}"


def main() -> int:
    text = README.read_text()
    new = render(text)
    if "--check" in sys.argv[1:]:
        if new != text:
            print(f"{README} config reference is stale: run python -m training.docs", file=sys.stderr)
            return 1
        return 0
    if new != text:
        README.write_text(new)
        print(f"updated {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
