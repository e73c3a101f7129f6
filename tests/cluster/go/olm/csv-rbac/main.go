// Command csv-rbac prints the RBAC that OLM creates for a ClusterServiceVersion: the
// ServiceAccounts, Roles, RoleBindings, ClusterRoles and ClusterRoleBindings of its install
// strategy's permissions and clusterPermissions, made by OLM's own resolver
// (resolver.RBACForClusterServiceVersion, which the catalog operator's InstallPlans apply).
//
// The harness runs OLM's olm-operator but not its catalog operator (bundle unpacking needs pods
// that really run), so the e2e tests create what an InstallPlan would from this output.
//
//	csv-rbac < live-csv.json > rbac.json   # a List; the CSV as the API server returns it (UID set)
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"sort"

	"github.com/operator-framework/api/pkg/operators/v1alpha1"
	"github.com/operator-framework/operator-lifecycle-manager/pkg/controller/registry/resolver"
	"sigs.k8s.io/yaml"
)

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "csv-rbac: "+format+"\n", args...)
	os.Exit(1)
}

func typed(apiVersion, kind string, object any) map[string]any {
	raw, err := json.Marshal(object)
	if err != nil {
		fail("encoding a %s: %v", kind, err)
	}
	out := map[string]any{}
	if err := json.Unmarshal(raw, &out); err != nil {
		fail("decoding a %s: %v", kind, err)
	}
	out["apiVersion"], out["kind"] = apiVersion, kind
	return out
}

func main() {
	input, err := io.ReadAll(os.Stdin)
	if err != nil {
		fail("reading the CSV: %v", err)
	}
	var csv v1alpha1.ClusterServiceVersion
	if err := yaml.Unmarshal(input, &csv); err != nil {
		fail("parsing the CSV: %v", err)
	}
	if csv.UID == "" || csv.Namespace == "" {
		fail("the CSV has no uid or namespace: pass it as the API server returns it")
	}
	permissions, err := resolver.RBACForClusterServiceVersion(&csv)
	if err != nil {
		fail("%v", err)
	}
	accounts := make([]string, 0, len(permissions))
	for name := range permissions {
		accounts = append(accounts, name)
	}
	sort.Strings(accounts)
	var items []map[string]any
	for _, name := range accounts {
		p := permissions[name]
		// The resolver leaves the namespace of an account that only has clusterPermissions
		// empty; the InstallPlan creates its namespaced steps in the CSV's namespace.
		if p.ServiceAccount.Namespace == "" {
			p.ServiceAccount.Namespace = csv.Namespace
		}
		items = append(items, typed("v1", "ServiceAccount", p.ServiceAccount))
		for _, r := range p.Roles {
			items = append(items, typed("rbac.authorization.k8s.io/v1", "Role", r))
		}
		for _, r := range p.RoleBindings {
			items = append(items, typed("rbac.authorization.k8s.io/v1", "RoleBinding", r))
		}
		// Cluster-scoped: a namespace the resolver copied from the CSV means nothing there.
		for _, r := range p.ClusterRoles {
			r.Namespace = ""
			items = append(items, typed("rbac.authorization.k8s.io/v1", "ClusterRole", r))
		}
		for _, r := range p.ClusterRoleBindings {
			r.Namespace = ""
			items = append(items, typed("rbac.authorization.k8s.io/v1", "ClusterRoleBinding", r))
		}
	}
	out, err := json.MarshalIndent(map[string]any{"apiVersion": "v1", "kind": "List", "items": items}, "", "  ")
	if err != nil {
		fail("%v", err)
	}
	fmt.Println(string(out))
}
