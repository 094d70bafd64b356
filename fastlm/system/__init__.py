"""The ground floor of the runtime: helpers any package may use (full-disk errors, autocast, error lines).
It imports no package of fastlm, so the data, logging and generation packages need not reach up to the engine.
"""
