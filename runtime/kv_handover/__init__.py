"""Per-phase KV dtype at the prefill -> decode handover (docs/kv-handover.md).

`negotiate` decides, per decode peer, how the prefill's pages become the peer's layout (pure);
`sglang_plugin` installs that decision into SGLang's own Mooncake transfer path.
"""
