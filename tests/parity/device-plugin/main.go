// Command device-plugin-parity loads device plugin config files with the plugin's own config
// package (github.com/NVIDIA/k8s-device-plugin/api/config/v1, the version pinned in go.mod) and
// applies the checks the plugin makes before it starts, printing one line per file:
//
//	<file>\taccept\t
//	<file>\treject\t<error>
//
// Flags and environment variables are read the way the plugin reads them (MIG_STRATEGY,
// MPS_ROOT, DEVICE_LIST_STRATEGY, ... beat the file), so the caller sets the environment the
// operator gives the plugin. The start-up checks live in the plugin's main package
// (cmd/nvidia-device-plugin), which cannot be imported; validate restates them, reading the
// merged flags through their JSON names so that it depends on nothing but NewConfig and the
// sharing strategy.
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"

	spec "github.com/NVIDIA/k8s-device-plugin/api/config/v1"
	cli "github.com/urfave/cli/v2"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: device-plugin-parity FILE...")
		os.Exit(2)
	}
	for _, file := range os.Args[1:] {
		if err := load(file); err != nil {
			fmt.Printf("%s\treject\t%s\n", file, oneLine(err.Error()))
		} else {
			fmt.Printf("%s\taccept\t\n", file)
		}
	}
}

// pluginFlags are the plugin's command-line flags that feed its config, with the plugin's
// names, defaults and environment variables.
func pluginFlags() []cli.Flag {
	return []cli.Flag{
		&cli.StringFlag{Name: "config-file", EnvVars: []string{"CONFIG_FILE"}},
		&cli.StringFlag{Name: "mig-strategy", Value: "none", EnvVars: []string{"MIG_STRATEGY"}},
		&cli.BoolFlag{Name: "fail-on-init-error", Value: true, EnvVars: []string{"FAIL_ON_INIT_ERROR"}},
		&cli.StringFlag{Name: "nvidia-driver-root", Value: "/", EnvVars: []string{"NVIDIA_DRIVER_ROOT"}},
		&cli.BoolFlag{Name: "pass-device-specs", EnvVars: []string{"PASS_DEVICE_SPECS"}},
		&cli.StringSliceFlag{Name: "device-list-strategy", Value: cli.NewStringSlice("envvar"), EnvVars: []string{"DEVICE_LIST_STRATEGY"}},
		&cli.StringFlag{Name: "device-id-strategy", Value: "uuid", EnvVars: []string{"DEVICE_ID_STRATEGY"}},
		&cli.StringFlag{Name: "mps-root", EnvVars: []string{"MPS_ROOT"}},
		&cli.StringFlag{Name: "device-discovery-strategy", Value: "auto", EnvVars: []string{"DEVICE_DISCOVERY_STRATEGY"}},
		&cli.IntSliceFlag{Name: "imex-channel-ids", EnvVars: []string{"IMEX_CHANNEL_IDS"}},
		&cli.BoolFlag{Name: "imex-required", EnvVars: []string{"IMEX_REQUIRED"}},
	}
}

func load(file string) error {
	app := cli.NewApp()
	app.Name = "device-plugin-parity"
	app.Flags = pluginFlags()
	app.HideHelp = true
	app.Action = func(c *cli.Context) error {
		config, err := spec.NewConfig(c, app.Flags)
		if err != nil {
			return fmt.Errorf("unable to finalize config: %v", err)
		}
		if err := validate(config); err != nil {
			return fmt.Errorf("unable to validate flags: %v", err)
		}
		return nil
	}
	return app.Run([]string{app.Name, "--config-file", file})
}

// mergedFlags is the part of the merged config the start-up checks read.
type mergedFlags struct {
	MigStrategy             *string `json:"migStrategy"`
	MpsRoot                 *string `json:"mpsRoot"`
	DeviceDiscoveryStrategy *string `json:"deviceDiscoveryStrategy"`
	Plugin                  *struct {
		DeviceListStrategy            json.RawMessage `json:"deviceListStrategy"`
		DeviceIDStrategy              *string         `json:"deviceIDStrategy"`
		SharedDevicesAllocationPolicy *string         `json:"sharedDevicesAllocationPolicy"`
	} `json:"plugin"`
}

func validate(config *spec.Config) error {
	raw, err := json.Marshal(config.Flags)
	if err != nil {
		return fmt.Errorf("parity wrapper: cannot read the merged flags: %v", err)
	}
	var flags mergedFlags
	if err := json.Unmarshal(raw, &flags); err != nil {
		return fmt.Errorf("parity wrapper: cannot read the merged flags: %v", err)
	}
	text := func(s *string) string {
		if s == nil {
			return ""
		}
		return *s
	}

	if flags.Plugin != nil && len(flags.Plugin.DeviceListStrategy) > 0 {
		var strategies []string
		if err := json.Unmarshal(flags.Plugin.DeviceListStrategy, &strategies); err != nil {
			var one string
			if err := json.Unmarshal(flags.Plugin.DeviceListStrategy, &one); err != nil {
				return fmt.Errorf("invalid --device-list-strategy option: %s", flags.Plugin.DeviceListStrategy)
			}
			strategies = []string{one}
		}
		for _, s := range strategies {
			switch s {
			case "envvar", "volume-mounts", "cdi-annotations", "cdi-cri":
			default:
				return fmt.Errorf("invalid --device-list-strategy option: invalid strategy: %v", s)
			}
		}
	}
	if flags.Plugin != nil {
		if id := text(flags.Plugin.DeviceIDStrategy); id != "uuid" && id != "index" {
			return fmt.Errorf("invalid --device-id-strategy option: %v", id)
		}
		switch text(flags.Plugin.SharedDevicesAllocationPolicy) {
		case "", "distributed", "packed":
		default:
			return fmt.Errorf("invalid shared devices allocation policy: %v", text(flags.Plugin.SharedDevicesAllocationPolicy))
		}
	}
	if config.Sharing.SharingStrategy() == spec.SharingStrategyMPS {
		if text(flags.MigStrategy) == "mixed" {
			return fmt.Errorf("using --mig-strategy=mixed is not supported with MPS")
		}
		if text(flags.MpsRoot) == "" {
			return fmt.Errorf("using MPS requires --mps-root to be specified")
		}
	}
	switch text(flags.DeviceDiscoveryStrategy) {
	case "auto", "nvml", "tegra":
	default:
		return fmt.Errorf("invalid --device-discovery-strategy option %v", text(flags.DeviceDiscoveryStrategy))
	}
	switch text(flags.MigStrategy) {
	case "none", "single", "mixed":
	default:
		return fmt.Errorf("unknown MIG strategy: %v", text(flags.MigStrategy))
	}
	imex, err := json.Marshal(config.Imex)
	if err != nil {
		return fmt.Errorf("parity wrapper: cannot read imex: %v", err)
	}
	var channels struct {
		ChannelIDs []int `json:"channelIDs"`
	}
	if err := json.Unmarshal(imex, &channels); err != nil {
		return fmt.Errorf("parity wrapper: cannot read imex: %v", err)
	}
	if len(channels.ChannelIDs) > 1 || (len(channels.ChannelIDs) == 1 && channels.ChannelIDs[0] != 0) {
		return fmt.Errorf("invalid IMEX channel IDs: %v", channels.ChannelIDs)
	}
	return nil
}

func oneLine(s string) string {
	return strings.NewReplacer("\n", " ", "\t", " ").Replace(s)
}
