"""Start the bundled trainer on every host of an inventory: topology, plan, launch (over ansible-runner)."""
