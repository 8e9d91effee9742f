"""`kvbridge proxy`: an OpenAI-compatible router in front of prefill and decode vLLM servers.

    kvbridge proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

Each POST /v1/completions or /v1/chat/completions is checked (validation.py), split into sub-requests of one
prompt and one choice (fanout.py: a list of P prompts with `n` choices is P * n of them) and each sub-request
becomes two legs, speaking the `kv_transfer_params` protocol of README.md:

1. prefill leg: the sub-request with `max_tokens=1` (and `max_completion_tokens=1` for chat), `stream=false`
   and `kv_transfer_params={"do_remote_decode": true}`, sent to the prefill backend with the fewest
   outstanding requests;
2. decode leg: the sub-request plus its own prefill reply's `kv_transfer_params`, sent to the decode backend
   with the fewest outstanding requests.

The decode replies go back to the client as they arrive: passed through for one sub-request, reassembled
(choice indexes rewritten, usage summed, SSE streams merged) for several (reassembly.py). A prefill whose decode
leg did not read its KV is released at once (releases.py).

Failures come back as OpenAI-shaped JSON `{"error": {"message", "type", "param", "code"}}` (errors.py); clients
see backends by name (`prefill-0`), the log by URL. A backend whose connection failed leaves the rotation until
its /health answers again (health.py); a leg that could not connect is retried on another backend of the same
kind (`connect_retries`), since nothing was sent. A client that disconnects aborts the legs in flight: the
upstream connection is closed, which makes vLLM abort the request.

Routing (router.py, docs/routing.md): `--routing cache_aware` (the default) sends a prompt to the instance that
likely holds its longest prefix (a prefix index per instance, fed by what was routed there), within a load bound;
`--disaggregation selective` sends a request straight to its decode instance when the tokens that instance would
compute itself are below a threshold learned from the servers' /metrics (or fixed: `--direct-below-tokens`).
Each decision is one log line and counted on /metrics; the output never depends on it.

GET /health (200 when each kind has a backend up, else 503; counts only), GET /metrics (Prometheus:
`kvbridge_proxy_*`), GET /v1/models (from a decode backend).

Glossary: a *leg* is one HTTP request to a backend; a *sub-request* is one prompt and one choice of a client
request, a prefill leg and a decode leg; a *backend* is one vLLM server of a kind (prefill or decode).

Modules, one idea each:
    balancer     which backend serves the next leg (pure)        health       backends out of rotation and back
    legs         sending one leg, retries, transport failures    validation   what the body must be, up front
    fanout       sub-requests and their legs' bodies (pure)      reassembly   replies and streams merged (pure)
    flow         the PD flow of one client request               releases     freeing KV nobody will read
    call         one client request and its reply                app          the Starlette app, the Proxy
    inbound      strict JSON bodies, plain request ids           connections  a deadline for each request's head
    config       ProxyConfig (typed, bounded)                    errors       the JSON errors clients get
    flags        the command line, one flag per config field   router       which instances, direct or PD, why
    prefix_index what prefix an instance likely holds (pure)    costs        the direct-or-PD threshold (pure)
    scrape       the backends' /metrics read for the costs
    metrics      kvbridge_proxy_* metrics                        server       the command line, socket, uvicorn
"""

from kvbridge.serving.proxy.app import Proxy
from kvbridge.serving.proxy.balancer import DECODE, KINDS, PREFILL, Backend, Balancer, NoBackendError
from kvbridge.serving.proxy.config import ProxyConfig
from kvbridge.serving.proxy.errors import InvalidRequest
from kvbridge.serving.proxy.fanout import Plan, SubRequest, decode_body, plan, prefill_body
from kvbridge.serving.proxy.inbound import parse_body, request_id
from kvbridge.serving.proxy.server import add_arguments, bind_socket, config_from_args, run, socket_url, uvicorn_config

__all__ = [
    "DECODE",
    "KINDS",
    "PREFILL",
    "Backend",
    "Balancer",
    "InvalidRequest",
    "NoBackendError",
    "Plan",
    "Proxy",
    "ProxyConfig",
    "SubRequest",
    "add_arguments",
    "bind_socket",
    "config_from_args",
    "decode_body",
    "parse_body",
    "plan",
    "prefill_body",
    "request_id",
    "run",
    "socket_url",
    "uvicorn_config",
]
