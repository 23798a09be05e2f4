"""`dflash monitor` and `dflash status`: watch a run from its event stream and log (light side).

Modules: `tailer` (follow files by offset), `alerts`, `system` (GPU/CPU/disk), `runs` (one run, the
runs under a root), `metrics` (Prometheus text), `server` (HTTP + SSE), `static/` (the page). What the
events say (`RunState`) is trainer/store/run_state.py, shared with `dflash plan --rate-from`."""
