// validate-bundle runs the operator-framework bundle validators
// (github.com/operator-framework/api/pkg/validation) over an OLM bundle folder, the same checks
// `operator-sdk bundle validate` makes, in three suites:
//
//   - default: the CSV, CRD and bundle validators OLM itself relies on
//   - operatorhub: OperatorHub.io's requirements (provider, maintainers, links, icon, version,
//     minKubeVersion, removed APIs) plus its capability and category vocabularies
//   - good-practices: resource requests, CRD descriptions, channel and bundle naming, CRD RBAC
//
// It prints one line per finding, `<suite>\t<ERROR|WARNING>\t<message>`, then one summary
// line per suite, and exits 1 when any suite reports an error, or a warning unless
// -allow-warnings is given; 2 when the bundle cannot be read.
package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/operator-framework/api/pkg/manifests"
	"github.com/operator-framework/api/pkg/validation"
	"github.com/operator-framework/api/pkg/validation/errors"
	interfaces "github.com/operator-framework/api/pkg/validation/interfaces"
)

type suite struct {
	name       string
	validators interfaces.Validators
}

var suites = []suite{
	{"default", validation.DefaultBundleValidators},
	{"operatorhub", interfaces.Validators{
		validation.OperatorHubV2Validator,
		validation.StandardCapabilitiesValidator,
		validation.StandardCategoriesValidator,
	}},
	{"good-practices", interfaces.Validators{validation.GoodPracticesValidator}},
}

func main() {
	k8sVersion := flag.String("k8s-version", "",
		"Kubernetes version the removed-API checks target (e.g. 1.33); empty: the CSV's minKubeVersion")
	allowWarnings := flag.Bool("allow-warnings", false, "exit 0 when there are warnings but no errors")
	flag.Usage = func() {
		fmt.Fprintf(os.Stderr, "usage: %s [flags] BUNDLE_DIR\n", os.Args[0])
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() != 1 {
		flag.Usage()
		os.Exit(2)
	}
	dir := flag.Arg(0)

	bundle, err := manifests.GetBundleFromDir(dir)
	if err != nil {
		fmt.Fprintf(os.Stderr, "reading the bundle in %s: %v\n", dir, err)
		os.Exit(2)
	}
	if bundle.CSV == nil {
		fmt.Fprintf(os.Stderr, "no ClusterServiceVersion found under %s/manifests\n", dir)
		os.Exit(2)
	}
	version := *k8sVersion
	if version == "" {
		version = bundle.CSV.Spec.MinKubeVersion
	}
	objects := append(bundle.ObjectsToValidate(), map[string]string{"k8s-version": version})

	failed := false
	for _, s := range suites {
		var errs, warns []errors.Error
		for _, result := range s.validators.Validate(objects...) {
			errs = append(errs, result.Errors...)
			warns = append(warns, result.Warnings...)
		}
		for _, e := range errs {
			fmt.Printf("%s\tERROR\t%s\n", s.name, e.Error())
		}
		for _, w := range warns {
			fmt.Printf("%s\tWARNING\t%s\n", s.name, w.Error())
		}
		fmt.Printf("suite %s: %d errors, %d warnings\n", s.name, len(errs), len(warns))
		if len(errs) > 0 || (len(warns) > 0 && !*allowWarnings) {
			failed = true
		}
	}
	fmt.Printf("bundle %s (CSV %s, package %s, channels %v, k8s-version %s)\n",
		dir, bundle.CSV.GetName(), bundle.Package, bundle.Channels, version)
	if failed {
		os.Exit(1)
	}
}
