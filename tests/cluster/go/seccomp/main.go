// Command seccomp-default prints, as JSON, the seccomp filter containerd applies to a container
// whose pod asks for `seccompProfile: {type: RuntimeDefault}`: containerd's DefaultProfile
// (contrib/seccomp, what its CRI plugin loads for RuntimeDefault), for the machine's
// architecture and kernel, widened for the capabilities named on the command line as containerd
// widens it for a container's bounding set.
//
//	seccomp-default [CAP_NAME...]   (e.g. CAP_NET_BIND_SERVICE)
//
// The output is the `linux.seccomp` object of an OCI runtime config.json, for runc.
package main

import (
	"encoding/json"
	"fmt"
	"os"

	"github.com/containerd/containerd/contrib/seccomp"
	"github.com/opencontainers/runtime-spec/specs-go"
)

func main() {
	spec := &specs.Spec{Process: &specs.Process{Capabilities: &specs.LinuxCapabilities{Bounding: os.Args[1:]}}}
	out, err := json.MarshalIndent(seccomp.DefaultProfile(spec), "", " ")
	if err != nil {
		fmt.Fprintf(os.Stderr, "seccomp-default: %v\n", err)
		os.Exit(1)
	}
	fmt.Println(string(out))
}
