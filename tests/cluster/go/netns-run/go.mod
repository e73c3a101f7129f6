module gpu-operator.local/harness/netns-run

go 1.26.3

require golang.org/x/sys v0.47.0
