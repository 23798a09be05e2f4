"""`dflash monitor` and `dflash status`: watch a run from its event stream and log (light side).

Modules: `tailer` (follow files by offset), `state` (what the events say), `alerts`, `system`
(GPU/CPU/disk), `runs` (one run, the runs under a root), `metrics` (Prometheus text),
`server` (HTTP + SSE), `static/` (the page)."""
