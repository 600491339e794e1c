"""The jobs a user runs, one module each, each with `run(config, workdir)` (and optionally `validate(config)`):
`main.JOBS` maps `config.job` to them. A job imports the rooms below it, never another job (docs/design.md)."""
