"""The ground floor of the runtime: helpers any package may use (full-disk errors, autocast, error lines, the
run directory's lock and files, process signals and fault points). It imports no package of fastlm above it,
so the data, logging, generation and RL packages need not reach up to the engine.
"""
