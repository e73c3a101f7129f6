# Entry points; the README names them. Rust builds and the harness binaries are cached under
# ~/.cache/gpu-operator (see tests/cluster/lib.sh and tests/cluster/build.sh).
SHELL := /bin/bash
.DEFAULT_GOAL := help

export CARGO_TARGET_DIR ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/gpu-operator/cargo-target

# `cargo xtask` (xtask/: the generated files) with a helm for the OLM bundle: $HELM when set,
# else the pinned helm, built alone by tests/cluster/build.sh (reused once built).
XTASK = set -o pipefail; helm="$${HELM:-$$(tests/cluster/build.sh helm | tail -1)/helm}" && HELM="$$helm" cargo xtask
# The same, running the xtask binary that `cargo test --workspace` builds (for xtask's own
# integration tests). `cargo xtask` resolves the features of xtask's dependencies alone, so on a
# cold machine it compiles tokio, hyper, kube and the operator a second time, with other
# features than the workspace's tests use.
XTASK_BUILT = set -o pipefail; helm="$${HELM:-$$(tests/cluster/build.sh helm | tail -1)/helm}" && HELM="$$helm" "$(CARGO_TARGET_DIR)/debug/xtask"

.PHONY: help
help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | expand -t 16

.PHONY: demo
demo: ## the operator on fake T4/A100/H100 nodes: chart installed, policy ready, time-slicing rolled out; stays up
	tests/demo/demo.sh

.PHONY: demo-down
demo-down: ## stop what `make demo` started
	tests/demo/demo-down.sh

.PHONY: test
test: unit e2e ## what CI runs: unit tests, then the harness and the end-to-end tests (all but the long suites)

.PHONY: test-long
test-long: image-check e2e-long ## the release checks: the image built twice and checked, then the long end-to-end suites (chaos, control-plane faults, the published release under runc, OLM from a catalog, krew, ConfigMap load)

.PHONY: tools
tools: harness olm-validator monitoring-check ## build (or reuse) every Go tool `make e2e` needs (.ci/run builds them beside the Rust builds)

.PHONY: unit
unit: ## the generated-file check (`cargo xtask check`), unit tests and golden files (no cluster needed)
	cargo test --workspace --exclude e2e --no-run
	$(XTASK_BUILT) check
	cargo test --workspace --exclude e2e
	cargo test -p e2e --lib --bins

.PHONY: e2e
e2e: tools ## end-to-end tests on three fresh harnesses side by side (started and stopped here), all but the long suites
	E2E_SUITE=core E2E_LANES=3 tests/e2e.sh

.PHONY: e2e-long
e2e-long: harness release-tools olm-catalog-tools ## the long end-to-end suites on a fresh harness: chaos, resilience, release, olm_catalog, krew, config_map_memory
	tests/cluster/build.sh krew >/dev/null
	E2E_SUITE=long tests/e2e.sh

.PHONY: image
image: ## the operator's OCI image archive, reproducibly, without a container daemon (prints its digest; docs/install.md)
	scripts/image.sh

.PHONY: release
release: ## publish to an OCI registry: the image (SBOM as a referrer), the chart naming it, the image list (REGISTRY=host[:port][/path] VERSION=...; docs/install.md)
	scripts/release.sh "$(REGISTRY)" "$(VERSION)"

.PHONY: image-check
image-check: ## build the image twice (same digest) and check it: layout, config, user, entrypoint, labels, the binary runs
	scripts/image-check.sh

.PHONY: harness
harness: ## build (or reuse) the Kubernetes, etcd, kwok, helm, NFD and OLM binaries
	tests/cluster/build.sh >/dev/null

.PHONY: release-tools
release-tools: ## build (or reuse) the OCI registry and oras that `make release` and its end-to-end test use, and what runs the image under runc (Debian's runc installed when missing)
	tests/cluster/build.sh registry oras helm >/dev/null
	tests/cluster/container-tools.sh >/dev/null

.PHONY: olm-catalog-tools
olm-catalog-tools: ## build (or reuse) opm and oras, which publish and serve the OLM catalog (make release, the e2e olm_catalog)
	tests/cluster/build.sh opm oras >/dev/null

.PHONY: olm-validator
olm-validator: ## build (or reuse) the operator-framework bundle validators the OLM tests run
	tests/olm/build.sh >/dev/null

.PHONY: monitoring-check
monitoring-check: ## build (or reuse) the checker of the alert rules and the Grafana dashboard (Prometheus' rule parser, Grafana's schema)
	tests/monitoring/build.sh >/dev/null

.PHONY: scale
scale: harness ## 1,000 fake GPU nodes and one DaemonSet: time to Ready and memory (N=... to change)
	tests/cluster/scale.sh $(or $(N),1000)

.PHONY: chaos
chaos: harness ## the chaos suite on its own harness (port base 16600): N seeded faults (default 100), invariants after each; CHAOS_SEED=... replays
	tests/chaos.sh $(or $(N),100)

.PHONY: bench
bench: harness ## operator benchmark on its own harness: convergence, rollout latency, memory, API traffic (N=100|1000|5000, OPERATOR_CMD=... to compare, OPERATOR_RUNTIME=runc for the image under the chart's limits)
	bench/run.sh $(or $(N),100)

.PHONY: chart
chart: ## regenerate every generated file: the CRDs, the chart's copies of them and of the operator's ClusterRole, bundle/ (`cargo xtask generate`)
	$(XTASK) generate

.PHONY: bundle
bundle: ## regenerate every generated file, the OLM bundle (bundle/) among them: the same as `make chart` (`cargo xtask generate`)
	$(XTASK) generate

.PHONY: lint
lint: lint-except-clippy ## formatting, clippy and cargo-deny (licences, bans, sources, advisories: deny.toml), as CI wants them
	cargo clippy --workspace --all-targets -- -D warnings

.PHONY: lint-except-clippy
lint-except-clippy: ## formatting, cargo-deny, and the harness Go tools' shared versions (tests/cluster/align-deps.py); CI runs clippy as it compiles the tests instead (.ci/run)
	cargo fmt --all -- --check
	scripts/cargo-deny.sh
	tests/cluster/align-deps.py --check
