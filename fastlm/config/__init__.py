"""Layered, typed configuration. Entry point: `fastlm.config.loader.load_config(path, overrides)`.

This package init stays import-free so section configs elsewhere can import `fastlm.config.base`
without pulling in the root schema (which imports them).
"""
