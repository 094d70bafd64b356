"""The ground floor of configuration: `base.ConfigModel` and the error types (`errors`), imported by
every package's section config. It imports no package of fastlm; the root schema that composes the
sections, the YAML loader and the cross-section checks live above them, in `fastlm.run_config`.
"""
