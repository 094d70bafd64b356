"""A run's configuration: the root schema (`schema.RunConfig`, composed of every package's section),
YAML layers and overrides (`loader.load_config(path, overrides)`), and the checks across sections
(`checks.cross_check`). It sits above the packages whose sections it composes; `fastlm.config`
below them holds only the base model and the error types every section imports.
"""
