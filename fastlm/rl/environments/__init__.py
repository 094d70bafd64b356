"""Multi-turn RL environments: the interface and its checks (base.py), the episode runner (episodes.py), the
chat-template token stream (transcript.py), Qwen/Hermes tool calls (tool_calls.py), the sandboxed calculator
(calculator.py) and the built-in calculator task (arithmetic.py). Nothing is imported here, so the
`rl:` config can import `environments.config` without a cycle."""
