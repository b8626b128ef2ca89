"""The node agent's collectors: one file each, registered by name, enabled by flag."""
