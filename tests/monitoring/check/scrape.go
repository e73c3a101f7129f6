package main

// scrape CONFIG: one scrape of every static target of every job in a Prometheus configuration,
// with the pieces of Prometheus' scrape loop that decide whether a scrape works: the file is
// loaded by Prometheus' config.LoadFile (its defaults and checks), each job's HTTP client is
// built by prometheus/common's NewClientFromConfig from the job's HTTPClientConfig (TLS,
// authorization, credentials files), as scrape.newScrapeClient does, and the body is read by
// Prometheus' textparse for the Content-Type the target answered with.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"sort"
	"strings"
	"time"

	commonconfig "github.com/prometheus/common/config"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/config"
	"github.com/prometheus/prometheus/discovery"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/model/textparse"
)

// The Accept header Prometheus sends with its default scrape protocols, text formats only:
// the parser below is chosen from the answer's Content-Type, as Prometheus chooses it.
const scrapeAccept = "application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.4,*/*;q=0.1"

// scrapeConfig scrapes every static target of every job in file and returns one problem line
// per failed target; expect names sample metric names every target must expose.
func scrapeConfig(file string, expect []string) []string {
	cfg, err := config.LoadFile(file, false, slog.New(slog.DiscardHandler))
	if err != nil {
		return []string{"loading the Prometheus configuration: " + err.Error()}
	}
	jobs, err := cfg.GetScrapeConfigs()
	if err != nil {
		return []string{"the configuration's scrape jobs: " + err.Error()}
	}
	var problems []string
	targets := 0
	for _, job := range jobs {
		client, err := commonconfig.NewClientFromConfig(job.HTTPClientConfig, job.JobName)
		if err != nil {
			problems = append(problems, fmt.Sprintf("job %s: building its HTTP client: %v", job.JobName, err))
			continue
		}
		for _, address := range staticAddresses(job) {
			targets++
			target := url.URL{Scheme: job.Scheme, Host: address, Path: job.MetricsPath}
			result, err := scrapeTarget(client, target.String(), time.Duration(job.ScrapeTimeout), job.ScrapeFallbackProtocol.HeaderMediaType())
			if err == nil {
				err = result.missing(expect)
			}
			if err != nil {
				problems = append(problems, fmt.Sprintf("job %s, target %s: %v", job.JobName, target.String(), err))
				continue
			}
			fmt.Printf("job %s, target %s: HTTP %d, %d samples, expected families present: %s\n",
				job.JobName, target.String(), result.status, result.samples, strings.Join(expect, ","))
		}
	}
	if targets == 0 && len(problems) == 0 {
		problems = append(problems, "no static targets to scrape (static_configs of scrape_configs)")
	}
	return problems
}

// staticAddresses are the __address__ of the job's static_configs targets.
func staticAddresses(job *config.ScrapeConfig) []string {
	var addresses []string
	for _, sd := range job.ServiceDiscoveryConfigs {
		static, ok := sd.(discovery.StaticConfig)
		if !ok {
			continue
		}
		for _, group := range static {
			for _, target := range group.Targets {
				addresses = append(addresses, string(target[model.AddressLabel]))
			}
		}
	}
	return addresses
}

type scraped struct {
	status  int
	samples int
	names   map[string]bool
}

// scrapeTarget GETs target with client and parses a 200 answer; any other status is an error
// naming the status and the start of the body (the operator says there why it refused).
// fallback is the job's fallback_scrape_protocol for an answer without a usable Content-Type.
func scrapeTarget(client *http.Client, target string, timeout time.Duration, fallback string) (scraped, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, target, nil)
	if err != nil {
		return scraped{}, err
	}
	req.Header.Set("Accept", scrapeAccept)
	req.Header.Set("X-Prometheus-Scrape-Timeout-Seconds", fmt.Sprintf("%g", timeout.Seconds()))
	resp, err := client.Do(req)
	if err != nil {
		return scraped{}, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return scraped{}, fmt.Errorf("reading the body: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		return scraped{status: resp.StatusCode}, fmt.Errorf("HTTP %d: %.200s", resp.StatusCode, body)
	}
	return parseExposition(body, resp.Header.Get("Content-Type"), fallback, resp.StatusCode)
}

// parseExposition counts the samples of body and collects their metric names; a body
// Prometheus' parser rejects is an error.
func parseExposition(body []byte, contentType, fallback string, status int) (scraped, error) {
	options := textparse.ParserOptions{FallbackContentType: fallback}
	parser, err := textparse.New(body, contentType, labels.NewSymbolTable(), options)
	if parser == nil {
		return scraped{}, fmt.Errorf("no Prometheus parser for Content-Type %q: %v", contentType, err)
	}
	result := scraped{status: status, names: map[string]bool{}}
	var lset labels.Labels
	for {
		entry, err := parser.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return result, fmt.Errorf("parsing the exposition: %w", err)
		}
		if entry != textparse.EntrySeries {
			continue
		}
		parser.Labels(&lset)
		result.samples++
		result.names[lset.Get(labels.MetricName)] = true
	}
	if result.samples == 0 {
		return result, errors.New("HTTP 200 but no samples")
	}
	return result, nil
}

// missing is an error naming the expected metric names the scrape did not return.
func (s scraped) missing(expect []string) error {
	var absent []string
	for _, name := range expect {
		if !s.names[name] {
			absent = append(absent, name)
		}
	}
	if len(absent) == 0 {
		return nil
	}
	sort.Strings(absent)
	return fmt.Errorf("HTTP %d, %d samples, missing metric families: %s", s.status, s.samples, strings.Join(absent, ","))
}
