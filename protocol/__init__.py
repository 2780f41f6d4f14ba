"""The wire between the router and the nodes: a torch-free leaf (msgspec + enums) both sides import.

messages.py       every message (jobs, token batches, heartbeats, registration) and its enums
job_limits.py     the bounds of every job field: the router's schema and every node check them
peer_identity.py  `<node_id>/job|hb/<instance>`, the node sockets' ZeroMQ identities
defaults.py       the one source of the defaults `up`, the router, the nodes and the store share
"""
