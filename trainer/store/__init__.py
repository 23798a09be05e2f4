"""What a run leaves on disk and the proof of it: atomic writes (`fsutil.py`), manifests, checkpoint
folders, the event stream (`events.py`) and what it says (`run_state.py`), node markers, progress files.
Stdlib only: `python -m trainer.store.progress_file` runs on a node with a bare python3, so this file
imports nothing."""
