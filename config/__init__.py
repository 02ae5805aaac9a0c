"""The typed run configuration: one TOML file, a section per role, decoded into msgspec Structs.

`parley.config.run` holds RunConfig and its loader (every `parley` command calls `load_config`); each
role's sections live beside it (config.actor, config.scorer, config.learner, config.env).
"""
