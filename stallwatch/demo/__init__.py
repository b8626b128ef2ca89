"""The demo: a hub, a real nginx spoke, an emulated training job and the agent, on one machine."""
