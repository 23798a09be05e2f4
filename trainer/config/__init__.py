"""The run config: `run.py` (RunConfig, loading, `--set`), its sections (`section.py` the base,
`train.py` the `train:` section, `eval.py` the `eval:` section), `duration.py` (the time budget's
durations), `schema.py` (the reference), `user_yaml.py` (the one YAML reader). Light side: pydantic and
PyYAML only, and this file imports nothing."""
