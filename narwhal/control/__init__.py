"""The control plane: the router's state, its lease, maintenance and its own monitoring."""
