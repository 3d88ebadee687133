"""Print the table of canonical fields (docs/format.md) per algorithm, from the schema itself.

    python docs/fields_table.py                 # Markdown table on stdout

● = required (``tracer.format.schema.required_fields``: ``tracer check`` warns, ``fields.required``, when a
step lacks one, and the checks that need it are skipped);
○ = recorded by that algorithm's bundled sample traces (hand-written loops and TRL trainers), so
usually present; blank = optional, recorded when your trainer has it.
"""

from __future__ import annotations

from pathlib import Path

from tracer.read import Trace
from tracer.format.schema import ALGORITHMS, FIELDS, required_fields

SAMPLES = Path(__file__).resolve().parent.parent / "sample_traces"


def recorded_by_samples() -> dict[str, set[str]]:
    """Fields present in the first step file of every bundled sample trace, per algorithm."""
    out: dict[str, set[str]] = {algo: set() for algo in ALGORITHMS}
    for manifest in sorted(SAMPLES.glob("*/manifest.json")):
        trace = Trace(manifest.parent)
        keys = trace.steps()
        if keys and trace.algorithm in out:
            out[trace.algorithm] |= set(trace.fields(keys[0]))
    return out


def main() -> None:
    required = {algo: set(required_fields(algo)) for algo in ALGORITHMS}
    recorded = recorded_by_samples()
    print("| field | shape | " + " | ".join(ALGORITHMS) + " | what |")
    print("|---|---|" + "---|" * len(ALGORITHMS) + "---|")
    for name, spec in FIELDS.items():
        shapes = {"[" + ", ".join(spec.dims_for(a)) + "]" for a in ALGORITHMS}
        shape = "[" + ", ".join(spec.dims) + "]" + (" (PPO: [B, T])" if len(shapes) > 1 else "")
        marks = ["●" if name in required[a] else "○" if name in recorded[a] else "" for a in ALGORITHMS]
        unit = f" ({spec.unit})" if spec.unit in ("nats",) else ""
        what = (spec.description + unit).replace("|", "\\|")  # a pipe would end the Markdown cell
        print(f"| `{name}` | {shape} | " + " | ".join(marks) + f" | {what} |")


if __name__ == "__main__":
    main()
