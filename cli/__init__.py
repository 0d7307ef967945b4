"""The `unbroken` command: the dispatcher (main.py), one module per subcommand, the operator
client, and `unbroken up` with its drill. It may import every other part; nothing imports it."""
