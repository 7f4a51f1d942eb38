"""Prepared KV pools and the launch map of every stage and peer, below every command."""
