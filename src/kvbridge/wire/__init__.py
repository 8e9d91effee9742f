"""What crosses process boundaries: the side channel's msgspec messages (`messages`), the `kv_transfer_params`
a prefill returns and a decode receives (`params`), and the ZMQ shell that carries messages (`side_channel`).

Built on `kvbridge.core` only.
"""
