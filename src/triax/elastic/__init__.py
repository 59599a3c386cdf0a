"""Elastic runs: `triax supervise` running a train command as N processes and
relaunching it on the devices left when one fails (supervisor), the heartbeat
file a trainer touches after each step (heartbeat), and the layout chosen for
the devices left (replan)."""
