"""One markdown table of families x pairs from the e2e modules' TTFT files (`KVBRIDGE_TTFT_OUT`, see
tests/e2e_support.write_ttft_report): per pair the PD TTFT median (prefill leg + decode leg to its first token)
and the aggregated median (the decode server answering the same prompts on its own, after the PD legs), and both
for the pair's last prompt (the first prompt of a pair can pay one-off costs), with each file's command, host and
commit below the table.

    python bench/ttft_matrix.py bench/results/ttft-*-20261201-*.json > bench/results/ttft-matrix.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ORDER = ["plain", "mla", "hma", "mamba2", "mamba2-tp", "fp8", "block-sizes"]
NAMES = {
    "plain": "plain attention",
    "mla": "MLA",
    "hma": "sliding-window (HMA)",
    "mamba2": "Mamba2 hybrid",
    "mamba2-tp": "Mamba2 hybrid",
    "fp8": "FP8 KV",
    "block-sizes": "block-size mismatch",
}


def short(layout: str) -> str:
    """ "pp=2,tp=1" -> "pp2", "pp=1,tp=2" -> "tp2", "pp=1,tp=1" -> "pp1"."""
    sizes = dict(x.split("=") for x in layout.split(","))
    pp, tp = int(sizes["pp"]), int(sizes["tp"])
    if pp > 1 and tp > 1:
        return f"pp{pp}tp{tp}"
    return f"tp{tp}" if tp > 1 else f"pp{pp}"


def equal(row: dict, prompts: int) -> str:
    if "equal_to_reference" in row:
        return f"{row['equal_to_reference']}/{prompts} (= NixlConnector)"
    return f"{row.get('equal_to_aggregated', '?')}/{prompts}"


def table(reports: list[tuple[Path, dict]]) -> str:
    reports = sorted(reports, key=lambda r: ORDER.index(r[1]["family"]) if r[1]["family"] in ORDER else 99)
    lines = [
        "| family | prefill → decode | servers | prompts (tokens) | token-identical | PD TTFT median (ms) |"
        " aggregated TTFT median (ms) | PD / aggregated | last prompt: PD / aggregated (ms) | file |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for path, report in reports:
        prompts = report.get("prompt_tokens", [])
        for row in report["pairs"]:
            pair = f"{short(row['prefill'])}→{short(row['decode'])}"
            if "blocks" in row:
                pair += f" (block {row['blocks']})"
            pd, agg = row["median_ttft_ms"], row["median_aggregated_ttft_ms"]
            last = f"{row['ttft_ms'][-1]:.0f} / {row['aggregated_ttft_ms'][-1]:.0f}"
            lines.append(
                f"| {NAMES.get(report['family'], report['family'])} | {pair} | {row.get('servers', '')} |"
                f" {', '.join(map(str, prompts))} | {equal(row, len(prompts))} | {pd:.0f} | {agg:.0f} |"
                f" {pd / agg:.1f}x | {last} | `{path.name}` |"
            )
    lines.append("")
    for path, report in reports:
        lines.append(
            f"- `{path.name}`: {report['model']}; `{report['command']}`; {report['host']}; commit "
            f"{report.get('commit', '?')}, finished {report.get('finished_utc', '?')}"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args(argv)
    reports = [(path, json.loads(path.read_text())) for path in args.files]
    sys.stdout.write(table(reports))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
