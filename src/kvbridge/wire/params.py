"""The `kv_transfer_params` protocol, as vLLM's NixlConnector speaks it, so existing PD proxies work unchanged.

1. The client (or proxy) sends the prompt to a prefill server with `max_tokens=1` and
   `kv_transfer_params: {"do_remote_decode": true}`.
2. The prefill server's response carries `kv_transfer_params` (`PrefillDone` below): where the prompt's KV is
   and how the prefill instance is laid out.
3. The client sends the same prompt to a decode server with those params; it reads the KV and generates.

Fields of the prefill response (all of NixlConnector's that a decode side needs, plus kvbridge's):
    do_remote_prefill   true: the decode side must fetch the prompt's KV
    do_remote_decode    false
    remote_engine_id    the prefill engine's id (one per DP rank)
    remote_request_id   the request id on the prefill engine (the key its blocks are held under)
    remote_block_ids    the prefill engine's block ids of the prompt, in order (one KV-cache group)
    remote_group_block_ids  with several KV-cache groups (vLLM's hybrid KV-cache manager), instead: per group, its
                        blocks of the prompt without the null blocks, aligned to the prompt's end (a sliding-window
                        group's in-window tail; `core.groups`); `remote_block_ids` is then empty (kvbridge)
    remote_host         side-channel address of the prefill instance
    remote_port         side-channel base port; each worker listens on a port derived from it
    remote_dp_rank      the prefill engine's DP rank (kvbridge)
    remote_layout       the prefill layout, e.g. "pp=2,tp=1" (kvbridge)
    remote_num_tokens   prompt tokens whose KV the prefill computed: all N, or N-1 for a model with state (Mamba),
                        whose decode computes the last one (`core.groups.computed_tokens`)
    remote_block_size   tokens per prefill block (kvbridge): may differ from the decode's (`core.token_runs`)
    tp_size, pp_size    the prefill layout as NixlConnector reports it
    kvbridge_protocol   kvbridge's wire protocol version (kvbridge)
    remote_prompt_hash  hash of the prompt's token ids and of everything else that shapes its KV (`prompt_hash`,
                        `kv_extras`: LoRA adapter, cache_salt, multimodal inputs, prompt embeddings): the KV is
                        this prompt's and no other's
    remote_token        the request's secret: claims, notifications and aborts must carry it
    remote_expires      unix time after which the prefill no longer holds the blocks for an unclaimed read
    remote_model        the prefill's model fingerprint (`core.model_identity`: an 8-hex digest per part: config,
                        tokenizer, weights, quantization, kv_cache_dtype); a decode with another refuses the
                        params, naming the parts that differ
    remote_issued       unix time the prefill issued the params (kvbridge): a decode refuses them unread if the
                        prefill worker it reaches started later (a restart on the same address: a new epoch)
    kvbridge_key_id     which deployment key signed them (`wire.keys`: an instance accepts several while a key
                        is rotated)
    kvbridge_sig        HMAC-SHA256 of all the above with the params key derived from that deployment key
                        (absent without a key)

A decode instance loads the KV only for a request whose prompt (its first N-1 tokens with state) has
`remote_num_tokens` tokens hashing, with its `kv_extras`, to `remote_prompt_hash` (`check_binding`), and with a
key only params the prefill signed, unexpired; otherwise the request is prefilled locally (or fails under
kv_load_failure_policy=fail), and a counter says why.
"""

from __future__ import annotations

import functools
import hashlib
import sys
from array import array
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec

from kvbridge.core.errors import LayoutError, ParamsRefused, RequestParamsError
from kvbridge.core.model_identity import digest_differences
from kvbridge.core.topology import ParallelLayout
from kvbridge.wire import auth
from kvbridge.wire.keys import KeyRing
from kvbridge.wire.messages import PROTOCOL_VERSION

_SIGNED = b"kv_transfer_params-v2"
_EXTRAS_TAG = b"kvbridge-kv-extras-v1\0"
MAX_WORKERS = 65536
"""No parsed params name a larger prefill layout (the config's max_remote_workers is usually far smaller)."""
MAX_BLOCKS = 1 << 20
"""The default of config `max_remote_blocks`: most block ids (all groups together) parsed params may list."""
MAX_GROUPS = 64

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
BlockId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
"""A block id: vLLM's are small indexes; larger ones (such as 2**63) are refused when the params are parsed,
not deep in a transfer thread."""


class PrefillDone(msgspec.Struct, frozen=True, kw_only=True):
    """What a prefill instance returns and a decode instance receives (see the module docstring)."""

    do_remote_prefill: bool = True
    do_remote_decode: bool = False
    remote_engine_id: str
    remote_request_id: str
    remote_block_ids: list[BlockId]
    remote_host: str
    remote_port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    remote_dp_rank: NonNegative = 0
    remote_layout: str
    remote_num_tokens: NonNegative = 0
    tp_size: int = 1
    pp_size: int = 1
    kvbridge_protocol: int = PROTOCOL_VERSION
    remote_prompt_hash: str = ""
    remote_token: str = ""
    remote_expires: float = 0.0
    kvbridge_sig: str = ""
    remote_group_block_ids: list[list[BlockId]] = []
    remote_block_size: NonNegative = 0
    """Tokens per prefill block (kvbridge); 0 from older prefill instances: the decode's own."""
    remote_model: str = ""
    """The prefill's model fingerprint (`ModelFingerprint.digest`); "" from engines without one (tests)."""
    kvbridge_key_id: str = ""
    """The id (hex) of the deployment key whose params key made `kvbridge_sig`."""
    remote_issued: float = 0.0
    """Unix time the prefill issued these params (kvbridge; 0: not said): params older than the start of the
    prefill worker a decode reaches are of an earlier run of that engine, and are refused unread."""

    @property
    def layout(self) -> ParallelLayout:
        return _parse_layout(self.remote_layout)

    @property
    def group_block_ids(self) -> tuple[list[int], ...]:
        """The block lists per KV-cache group: `remote_group_block_ids`, or the one group's `remote_block_ids`."""
        return tuple(self.remote_group_block_ids) if self.remote_group_block_ids else (self.remote_block_ids,)

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    def _payload(self) -> bytes:
        return msgspec.msgpack.encode(msgspec.structs.replace(self, kvbridge_sig=""))

    def signed(self, key: bytes | KeyRing) -> PrefillDone:
        """These params with `kvbridge_key_id` (the current key's) and `kvbridge_sig` set: an HMAC over every
        other field with the params key derived from the deployment key."""
        current = KeyRing.of(key).current
        named = msgspec.structs.replace(self, kvbridge_key_id=current.key_id.hex())
        return msgspec.structs.replace(named, kvbridge_sig=auth.sign(current.params, _SIGNED, named._payload()))

    def verify(self, key: bytes | KeyRing) -> bool:
        """Whether one of the accepted keys (the one `kvbridge_key_id` names) signed these params."""
        try:
            signer = KeyRing.of(key).get(bytes.fromhex(self.kvbridge_key_id))
        except ValueError:
            return False
        return signer is not None and auth.verify(signer.params, _SIGNED, self._payload(), self.kvbridge_sig)


def prompt_hash(token_ids: Sequence[int], extras: tuple[Any, ...] = ()) -> str:
    """The identity of a prompt's computed prefix, 32 hex: SHA-256 of its token ids (uint32, little-endian), and
    with `extras` (`kv_extras`) SHA-256 of a domain tag, the token count, the ids and the msgpack of the extras.
    Without extras the value is the tokens-only hash of earlier versions."""
    data = array("I", token_ids)  # 4 bytes on every platform CPython supports
    if sys.byteorder == "big":  # pragma: no cover
        data.byteswap()
    if not extras:
        return hashlib.sha256(data.tobytes()).hexdigest()[:32]
    digest = hashlib.sha256(_EXTRAS_TAG + len(data).to_bytes(8, "little") + data.tobytes())
    digest.update(msgspec.msgpack.encode(extras))
    return digest.hexdigest()[:32]


def kv_extras(request: Any) -> tuple[Any, ...]:
    """What besides its token ids makes a vLLM request's KV what it is, as vLLM 0.32's prefix cache keys a block
    (`kv_cache_utils.generate_block_hash_extra_keys`): the LoRA adapter (name and path), the cache salt, each
    multimodal input (its content hash and where its placeholder tokens sit) and prompt embeddings (a digest of
    the tensor and of the token/embedding mask). Read by attribute name (a vLLM `Request`, or any object with
    those attributes); empty for a plain prompt. Prefill and decode must load an adapter under the same name and
    path, as vLLM's own cache requires."""
    extras: list[Any] = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        extras.append(("lora", str(lora.lora_name), str(getattr(lora, "lora_path", "") or "")))
    salt = getattr(request, "cache_salt", None)
    if salt:
        extras.append(("cache_salt", str(salt)))
    for feature in getattr(request, "mm_features", None) or ():
        place = feature.mm_position
        extras.append(("mm", str(feature.identifier), int(place.offset), int(place.length)))
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is not None:
        mask = getattr(request, "prompt_is_token_ids", None)
        extras.append(("prompt_embeds", _tensor_digest(embeds), bytes(bool(m) for m in mask) if mask else b""))
    return tuple(extras)


def _tensor_digest(tensor: Any) -> str:
    """SHA-256 of a torch tensor's dtype, shape and bytes (only imported for requests with prompt embeddings)."""
    import torch

    flat = tensor.detach().to("cpu").contiguous()
    digest = hashlib.sha256(f"{flat.dtype}{tuple(flat.shape)}".encode())
    digest.update(flat.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def check_binding(
    done: PrefillDone,
    prompt_token_ids: Sequence[int],
    *,
    key: bytes | KeyRing | None,
    now: float,
    max_workers: int,
    window_s: float = 30.0,
    check_prompt: bool = True,
    extras: tuple[Any, ...] = (),
    model: str = "",
) -> None:
    """Raise ParamsRefused (its `reason` is the metric label) unless `done` may be loaded for this prompt: signed
    with `key` (when there is one), not expired, by an engine of this `model` fingerprint (when the params name
    one: the handshake compares it part by part anyway), a layout within `max_workers`, and computed for exactly these
    tokens and `extras` (`kv_extras` of the request; `check_prompt` False skips only that last comparison: the
    tests' negative control). Nothing here
    connects anywhere or allocates anything."""
    if key is not None:
        if not done.kvbridge_sig:
            raise ParamsRefused("unsigned", "kv_transfer_params: kvbridge_sig is missing (this decode has a key)")
        ring = KeyRing.of(key)
        if done.kvbridge_key_id not in ring.ids:
            raise ParamsRefused(
                "unknown_key",
                f"kv_transfer_params: kvbridge_key_id {done.kvbridge_key_id!r} is none of this instance's keys "
                f"{list(ring.ids)} (a key rotated on the prefill but not here? see auth_accepted_key_files)",
            )
        if not done.verify(ring):
            raise ParamsRefused("bad_signature", "kv_transfer_params: kvbridge_sig does not match the params")
    if done.remote_expires and now > done.remote_expires + window_s:
        ago = now - done.remote_expires
        raise ParamsRefused(
            "expired",
            f"kv_transfer_params: remote_expires passed {ago:.0f} s ago by this host's clock (if the request is new, "
            "this host's clock is ahead of the prefill host's by that much more than auth_window_s: fix the clocks)",
        )
    if done.remote_model and done.remote_model != model:  # else the handshake compares the parts
        raise ParamsRefused(
            "model",
            f"kv_transfer_params: remote_model (the prefill's model fingerprint) differs from this instance's in "
            f"{', '.join(digest_differences(done.remote_model, model))} ({done.remote_model!r} against {model!r})",
        )
    layout = done.layout
    if layout.dp * layout.workers_per_engine > max_workers:
        raise ParamsRefused(
            "layout", f"kv_transfer_params: remote_layout {layout} has more than max_remote_workers={max_workers}"
        )
    if not check_prompt:
        return
    if done.remote_num_tokens != len(prompt_token_ids):
        raise ParamsRefused(
            "prompt_length",
            f"kv_transfer_params: remote_num_tokens is {done.remote_num_tokens} but the prompt has "
            f"{len(prompt_token_ids)} tokens",
        )
    if not done.remote_prompt_hash or done.remote_prompt_hash != prompt_hash(prompt_token_ids, extras):
        raise ParamsRefused("prompt_hash", "kv_transfer_params: remote_prompt_hash is not this prompt's")


@functools.lru_cache(maxsize=64)
def _parse_layout(text: str) -> ParallelLayout:
    """Deployments use a handful of layouts; parsing each once keeps the scheduler's per-request cost low."""
    return ParallelLayout.parse(text)


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    """Prefill side: did the client ask us to hand the KV to a decode instance?"""
    return bool(params) and params.get("do_remote_decode") is True


def wants_remote_prefill(params: dict[str, Any] | None) -> bool:
    """Decode side: did the client bring a prefill instance's KV location?"""
    return bool(params) and bool(params.get("do_remote_prefill"))


def parse_prefill_done(params: dict[str, Any], max_blocks: int = MAX_BLOCKS) -> PrefillDone:
    """Validate a decode request's kv_transfer_params (at most `max_blocks` block ids); RequestParamsError names
    the bad field."""
    raw = dict(params)
    blocks = raw.get("remote_block_ids")
    # NixlConnector sends one list per KV cache group; a model with one group sends [[...]].
    if isinstance(blocks, list | tuple) and len(blocks) == 1 and isinstance(blocks[0], list | tuple):
        raw["remote_block_ids"] = list(blocks[0])
    elif isinstance(blocks, list | tuple) and blocks and all(isinstance(b, list | tuple) for b in blocks):
        if raw.get("remote_group_block_ids"):
            raise RequestParamsError("kv_transfer_params: remote_block_ids and remote_group_block_ids both per group")
        raw["remote_group_block_ids"], raw["remote_block_ids"] = [list(b) for b in blocks], []
    if "remote_layout" not in raw and "tp_size" in raw:
        raw["remote_layout"] = f"pp={raw.get('pp_size', 1)},tp={raw['tp_size']}"
    try:
        done = msgspec.convert(raw, PrefillDone)
    except msgspec.ValidationError as exc:
        raise RequestParamsError(f"kv_transfer_params: {exc}") from None
    if (
        len(done.remote_layout) > 64
        or len(done.remote_request_id) > 512
        or len(done.remote_engine_id) > 512
        or len(done.kvbridge_key_id) > 64
        or len(done.remote_model) > 64
    ):
        raise RequestParamsError("kv_transfer_params: remote_layout, remote_request_id or remote_engine_id too long")
    try:
        layout = done.layout
    except LayoutError as exc:
        raise RequestParamsError(f"kv_transfer_params: remote_layout: {exc}") from None
    if layout.dp * layout.workers_per_engine > MAX_WORKERS:  # before anything enumerates the workers
        raise RequestParamsError(f"kv_transfer_params: remote_layout {layout} has more than {MAX_WORKERS} workers")
    if len(done.remote_group_block_ids) > MAX_GROUPS or (done.remote_group_block_ids and done.remote_block_ids):
        raise RequestParamsError(
            "kv_transfer_params: remote_group_block_ids has too many groups, or both lists are set"
        )
    blocks = sum(map(len, done.group_block_ids))
    if blocks > max_blocks or len(done.remote_token) > 64 or len(done.remote_host) > 256:
        raise RequestParamsError("kv_transfer_params: remote_block_ids, remote_token or remote_host too long")
    if done.remote_dp_rank >= layout.dp and layout.dp > 1:
        raise RequestParamsError(
            f"kv_transfer_params: remote_dp_rank {done.remote_dp_rank} is outside the layout's dp={layout.dp}"
        )
    if done.kvbridge_protocol != PROTOCOL_VERSION:
        raise RequestParamsError(
            f"kv_transfer_params: kvbridge_protocol is {done.kvbridge_protocol} but this side speaks {PROTOCOL_VERSION}"
        )
    return done
