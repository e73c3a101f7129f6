// monitoring-check checks the operator's Prometheus rules and Grafana dashboards with the
// projects' own code, so a rule or dashboard that Prometheus or Grafana would refuse fails here:
//
//   - rules FILE...: each file (Prometheus rule groups, the spec of a PrometheusRule) is parsed
//     by github.com/prometheus/prometheus/model/rulefmt, which rejects unknown fields and parses
//     every PromQL expression and annotation template, as `promtool check rules` does.
//
//   - dashboard FILE...: each file is decoded strictly into the dashboard types of
//     github.com/grafana/grafana-foundation-sdk/go (Grafana's schema: unknown fields, wrong
//     types and missing required fields are errors); panel options and Prometheus queries are
//     decoded strictly too, so only the panel types registered below are accepted.
//
//   - scrape CONFIG: loads a Prometheus configuration and scrapes each static target of each
//     job once, as Prometheus would (scrape.go); it prints per target the HTTP status, the
//     sample count and the expected families found, and fails on a status other than 200, a
//     body Prometheus cannot parse, or a name -expect lists that the target lacks.
//
// With -metrics FILE (one metric name a line, # comments), every metric name a rule
// expression or a dashboard query selects must be listed there, so a misspelt name fails.
// Exit status: 0 clean, 1 a finding (one line each on stderr), 2 bad usage.
package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"regexp"
	"sort"
	"strings"

	"github.com/grafana/grafana-foundation-sdk/go/cog"
	"github.com/grafana/grafana-foundation-sdk/go/dashboard"
	"github.com/grafana/grafana-foundation-sdk/go/prometheus"
	"github.com/grafana/grafana-foundation-sdk/go/stat"
	"github.com/grafana/grafana-foundation-sdk/go/timeseries"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/model/rulefmt"
	"github.com/prometheus/prometheus/promql/parser"
)

// panelTypes are the panel types a dashboard may use: those whose options are decoded strictly.
var panelTypes = map[string]bool{"row": true, "stat": true, "timeseries": true}

var promql = parser.NewParser(parser.Options{})

func main() {
	metricsFile := flag.String("metrics", "", "file of known metric names; every selected metric must be in it")
	expect := flag.String("expect", "", "scrape: comma-separated metric names every target must expose")
	flag.Usage = func() {
		fmt.Fprintln(os.Stderr, "usage: monitoring-check [-metrics FILE] rules|dashboard FILE...\n"+
			"       monitoring-check [-expect NAME,...] scrape CONFIG")
	}
	flag.Parse()
	args := flag.Args()
	if len(args) == 2 && args[0] == "scrape" {
		var names []string
		if *expect != "" {
			names = strings.Split(*expect, ",")
		}
		problems := scrapeConfig(args[1], names)
		for _, p := range problems {
			fmt.Fprintln(os.Stderr, p)
		}
		if len(problems) > 0 {
			os.Exit(1)
		}
		return
	}
	if len(args) < 2 || (args[0] != "rules" && args[0] != "dashboard") {
		flag.Usage()
		os.Exit(2)
	}
	var known map[string]bool
	if *metricsFile != "" {
		var err error
		if known, err = readNames(*metricsFile); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
	}
	var problems []string
	for _, file := range args[1:] {
		var found []string
		if args[0] == "rules" {
			found = checkRules(file, known)
		} else {
			found = checkDashboard(file, known)
		}
		for _, p := range found {
			problems = append(problems, file+": "+p)
		}
		if len(found) == 0 {
			fmt.Printf("%s: ok\n", file)
		}
	}
	for _, p := range problems {
		fmt.Fprintln(os.Stderr, p)
	}
	if len(problems) > 0 {
		os.Exit(1)
	}
}

func readNames(path string) (map[string]bool, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("reading the metric names: %w", err)
	}
	defer f.Close()
	names := map[string]bool{}
	scanner := bufio.NewScanner(f)
	for scanner.Scan() {
		line := strings.TrimSpace(scanner.Text())
		if line != "" && !strings.HasPrefix(line, "#") {
			names[line] = true
		}
	}
	return names, scanner.Err()
}

func checkRules(file string, known map[string]bool) []string {
	groups, errs := rulefmt.ParseFile(file, false, model.UTF8Validation, promql, slog.New(slog.DiscardHandler))
	var problems []string
	for _, err := range errs {
		problems = append(problems, err.Error())
	}
	if groups == nil {
		return problems
	}
	rules := 0
	for _, group := range groups.Groups {
		for _, rule := range group.Rules {
			rules++
			name := rule.Alert + rule.Record
			problems = append(problems, unknownMetrics("rule "+name, rule.Expr, known)...)
		}
	}
	if rules == 0 {
		problems = append(problems, "no rules")
	}
	return problems
}

// Grafana's interval variables, replaced by a duration before a query is parsed.
var grafanaVariable = regexp.MustCompile(`\$\{?__(rate_interval|interval|range)\}?`)

func checkDashboard(file string, known map[string]bool) []string {
	raw, err := os.ReadFile(file)
	if err != nil {
		return []string{err.Error()}
	}
	var board dashboard.Dashboard
	if err := decodeError(board.UnmarshalJSONStrict(raw)); err != nil {
		return []string{"not a valid Grafana dashboard: " + err.Error()}
	}
	var problems []string
	if board.Uid == nil || board.Title == nil {
		problems = append(problems, "the dashboard needs a uid and a title (provisioning keys on them)")
	}
	queries := 0
	panels, err := decodePanels(raw)
	if err != nil {
		return append(problems, err.Error())
	}
	for _, p := range panels {
		title := "panel " + p.title
		if !panelTypes[p.kind] {
			problems = append(problems, fmt.Sprintf("%s: panel type %q is not one this check decodes strictly", title, p.kind))
		}
		for _, query := range p.queries {
			queries++
			// Grafana's interval variables become a duration PromQL parses.
			expr := grafanaVariable.ReplaceAllString(query.Expr, "5m")
			problems = append(problems, unknownMetrics(title, expr, known)...)
		}
	}
	for _, variable := range board.Templating.List {
		if variable.Type != "query" || variable.Query == nil || variable.Query.String == nil {
			continue
		}
		// label_values(METRIC, LABEL): the metric must exist.
		q := *variable.Query.String
		if m := regexp.MustCompile(`^label_values\(\s*([A-Za-z_:][\w:]*)`).FindStringSubmatch(q); m != nil && known != nil && !known[m[1]] {
			problems = append(problems, fmt.Sprintf("variable %s: unknown metric %s", variable.Name, m[1]))
		}
	}
	if queries == 0 {
		problems = append(problems, "no Prometheus queries")
	}
	return problems
}

// unknownMetrics parses expr and names every metric it selects that known lacks.
func unknownMetrics(where, expr string, known map[string]bool) []string {
	parsed, err := promql.ParseExpr(expr)
	if err != nil {
		return []string{fmt.Sprintf("%s: %q: %v", where, expr, err)}
	}
	if known == nil {
		return nil
	}
	missing := map[string]bool{}
	for _, selector := range parser.ExtractSelectors(parsed) {
		for _, m := range selector {
			if m.Name == labels.MetricName && m.Type == labels.MatchEqual && !known[m.Value] {
				missing[m.Value] = true
			}
		}
	}
	var out []string
	for name := range missing {
		out = append(out, fmt.Sprintf("%s: unknown metric %s", where, name))
	}
	sort.Strings(out)
	return out
}

// panel is what the metric check needs of a panel.
type panel struct {
	title, kind string
	queries     []prometheus.Dataquery
}

// decodePanels decodes every panel of the dashboard, rows' panels included, and its queries.
// The SDK's strict decoders return their error list as an error even when it is empty, and its
// PanelOrRowPanel and Panel then drop what they decoded (real errors still surface, and the
// whole dashboard was decoded strictly before), so panels and queries are decoded one by one
// here.
func decodePanels(raw []byte) ([]panel, error) {
	var shape struct {
		Type    string            `json:"type"`
		Title   string            `json:"title"`
		Panels  []json.RawMessage `json:"panels"`
		Targets []json.RawMessage `json:"targets"`
		Fields  json.RawMessage   `json:"fieldConfig"`
	}
	var panels []panel
	var outer struct {
		Panels []json.RawMessage `json:"panels"`
	}
	if err := json.Unmarshal(raw, &outer); err != nil {
		return nil, err
	}
	for i, item := range outer.Panels {
		if err := json.Unmarshal(item, &shape); err != nil {
			return nil, fmt.Errorf("panels[%d]: %w", i, err)
		}
		if shape.Type == "row" {
			nested, err := decodePanels(item)
			if err != nil {
				return nil, fmt.Errorf("panels[%d]: %w", i, err)
			}
			panels = append(panels, nested...)
			continue
		}
		p := panel{title: shape.Title, kind: shape.Type}
		// The SDK's Panel decodes fieldConfig leniently; its own type has a strict decoder.
		if shape.Fields != nil {
			var fields dashboard.FieldConfigSource
			if err := decodeError(fields.UnmarshalJSONStrict(shape.Fields)); err != nil {
				return nil, fmt.Errorf("panels[%d].fieldConfig: %w", i, err)
			}
		}
		for j, target := range shape.Targets {
			var query prometheus.Dataquery
			if err := decodeError(query.UnmarshalJSONStrict(target)); err != nil {
				return nil, fmt.Errorf("panels[%d].targets[%d]: %w", i, j, err)
			}
			p.queries = append(p.queries, query)
		}
		panels = append(panels, p)
		shape.Targets, shape.Fields = nil, nil
	}
	return panels, nil
}

// decodeError is err unless it is an empty cog.BuildErrors (the SDK returns its error list as
// an error even when the list is empty).
func decodeError(err error) error {
	var list cog.BuildErrors
	if errors.As(err, &list) && len(list) == 0 {
		return nil
	}
	return err
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

func init() {
	runtime := cog.NewRuntime()
	runtime.RegisterPanelcfgVariant(stat.VariantConfig())
	runtime.RegisterPanelcfgVariant(timeseries.VariantConfig())
	runtime.RegisterDataqueryVariant(prometheus.VariantConfig())
}
