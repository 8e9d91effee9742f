"""The `kvbridge` command: `plan` (check a deployment), `demo` (a disaggregated run on this machine), `serve` (a
vLLM server with kvbridge), `proxy` (a prefill/decode router in front of such servers)."""

from __future__ import annotations

import argparse
import json
import sys

from kvbridge.core.errors import KVBridgeError
from kvbridge.core.memory import NAMED_LAYOUTS
from kvbridge.core.plan import make_plan
from kvbridge.core.plan_report import plan_json, plan_text, preferred_kv_layout, read_costs
from kvbridge.core.topology import DTYPE_SIZES, KVGeometry, ParallelLayout


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="show which workers talk and what each reads",
        description="Show, for a prefill and a decode layout, which decode worker reads which layers and "
        "KV heads from which prefill worker, with bytes per token and descriptor counts.",
    )
    p.add_argument("--prefill", required=True, help="prefill layout, e.g. pp=2,tp=1 (also dp=N, partition=a:b)")
    p.add_argument("--decode", required=True, help="decode layout, e.g. pp=1,tp=2")
    p.add_argument("--num-layers", type=int, required=True)
    p.add_argument("--num-kv-heads", type=int, required=True)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_SIZES))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--kv-layout",
        default="auto",
        choices=["auto", *NAMED_LAYOUTS],
        help="KV memory layout; auto: vLLM's GPU default LBNHC, or head-outer LBHNC when the TP sizes "
        "differ (what kvbridge asks vLLM for, so that a head range is one run per block)",
    )
    p.add_argument("--tokens", type=int, default=1024, help="request length for descriptor counts")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    geometry = KVGeometry(args.num_layers, args.num_kv_heads, args.head_size, args.dtype, args.block_size)
    plan = make_plan(ParallelLayout.parse(args.prefill), ParallelLayout.parse(args.decode), geometry)
    if args.tokens < 1:
        raise KVBridgeError(f"--tokens must be positive, got {args.tokens}")
    layout = preferred_kv_layout(plan) if args.kv_layout == "auto" else args.kv_layout
    costs = read_costs(plan, layout, args.tokens)
    if args.json:
        print(json.dumps(plan_json(plan, costs, layout, args.tokens), indent=2))
    else:
        print(plan_text(plan, costs, layout, args.tokens))
    return 0


def _add_demo(sub: argparse._SubParsersAction) -> None:
    from kvbridge.serving import demo

    p = sub.add_parser("demo", help="run a disaggregated prefill/decode demo on this machine", description=demo.__doc__)
    demo.add_arguments(p)
    p.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from kvbridge.serving import demo
    from kvbridge.serving.launcher import exit_on_sigterm

    exit_on_sigterm()  # SIGTERM stops the demo's servers, as Ctrl-C does
    try:
        return demo.run(args)
    except KeyboardInterrupt:
        print("\ninterrupted: every server was stopped", file=sys.stderr)
        return 130


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from kvbridge.serving import serve

    p = sub.add_parser(
        "serve",
        help="start a vLLM server with KVBridgeConnector (prefill, decode or both)",
        description=serve.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_arguments(p)
    p.set_defaults(run=lambda args: serve.run(args))


def _add_proxy(sub: argparse._SubParsersAction) -> None:
    from kvbridge.serving import proxy

    p = sub.add_parser(
        "proxy",
        help="an OpenAI-compatible router: prefill leg then decode leg, or straight to a decode instance",
        description=proxy.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    proxy.add_arguments(p)
    p.set_defaults(run=lambda args: proxy.run(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvbridge", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_plan(sub)
    _add_demo(sub)
    _add_serve(sub)
    _add_proxy(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except KVBridgeError as exc:
        print(f"kvbridge {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
