module kmm-fleet.local/nodes/probe

go 1.25.0
