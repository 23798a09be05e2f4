"""Hidden-state sources: where the drafter's context features come from.

The loop only knows `HiddenStateSource` (base.py) and gets one from `make_source` (factory.py).
`hooked.py` runs the target in process with forward hooks; the vLLM-server source (`vllm.py`, the
server it owns in `vllm_server.py`, the connector vLLM loads in `vllm_connector.py`) plugs in beside it
without touching the loop. `capture.py`: `dflash capture`, a source's features in a file."""
