"""kvbridge as a vLLM KV connector:

    --kv-transfer-config '{"kv_connector": "KVBridgeConnector", "kv_connector_module_path": "kvbridge.vllm",
                           "kv_role": "kv_producer"}'

vLLM imports this module in every process (API server, engine core, workers): it imports no NIXL.
"""

from kvbridge.vllm.connector import KVBridgeConnector

__all__ = ["KVBridgeConnector"]
