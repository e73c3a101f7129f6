// oci-image writes and checks the operator's OCI image archive with go-containerregistry's
// image model (manifests, configs, digests, OCI layouts), without a container daemon.
//
//	oci-image build -o OUT.oci.tar [--file DEST:MODE:SRC]... [--tree DIR]... --user U
//	        --entrypoint PATH [--env K=V]... [--label K=V]... --created EPOCH --ref-name TAG
//	        [--comment TEXT] (the layer's history comment; the operator image's by default)
//	oci-image check ARCHIVE [--user U] [--entrypoint PATH] [--label K=V]... [--require-label K]...
//	        [--absent PATH]... [--static PATH] [--extract PATH=FILE]... [--rootfs DIR]
//
// build writes one image with one layer and no base. Everything that could differ between two
// builds of the same inputs is fixed: entries are sorted, owned by 0:0, modes normalised, every
// time (tar mtimes, config and history "created") is --created, gzip carries no name or time,
// and the archive around the layout is written the same way. The manifest digest is printed.
//
// check reads an archive back: the layout's index, the manifest and config media types, every
// blob's digest and size and every layer's diff ID (validate.Image), then the expectations given
// as flags. It prints what `crane config`/`skopeo inspect` would show (user, entrypoint, labels)
// and the layer's files, and extracts files for the caller to run.
package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"debug/elf"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/google/go-containerregistry/pkg/v1/validate"
)

const refNameAnnotation = "org.opencontainers.image.ref.name"

func main() {
	if len(os.Args) < 2 {
		fail(errors.New("usage: oci-image build|check ... (see the source's header)"))
	}
	var err error
	switch os.Args[1] {
	case "build":
		err = build(os.Args[2:])
	case "check":
		err = check(os.Args[2:])
	default:
		err = fmt.Errorf("unknown command %q: build or check", os.Args[1])
	}
	if err != nil {
		fail(err)
	}
}

func fail(err error) {
	fmt.Fprintf(os.Stderr, "oci-image: %v\n", err)
	os.Exit(1)
}

// flags is a small parser for "--name value" pairs, several of which may repeat.
type flags map[string][]string

func parseFlags(args []string, known ...string) (flags, []string, error) {
	out := flags{}
	var positional []string
	for i := 0; i < len(args); i++ {
		a := args[i]
		if !strings.HasPrefix(a, "--") && a != "-o" {
			positional = append(positional, a)
			continue
		}
		name := strings.TrimLeft(a, "-")
		if name == "o" {
			name = "output"
		}
		value := ""
		if k, v, ok := strings.Cut(name, "="); ok {
			name, value = k, v
		} else {
			if i+1 >= len(args) {
				return nil, nil, fmt.Errorf("--%s needs a value", name)
			}
			i++
			value = args[i]
		}
		found := false
		for _, k := range known {
			found = found || k == name
		}
		if !found {
			return nil, nil, fmt.Errorf("unknown flag --%s", name)
		}
		out[name] = append(out[name], value)
	}
	return out, positional, nil
}

func (f flags) one(name string) string {
	if v := f[name]; len(v) > 0 {
		return v[len(v)-1]
	}
	return ""
}

// keyValues parses repeated K=V flags.
func (f flags) keyValues(name string) (map[string]string, error) {
	out := map[string]string{}
	for _, kv := range f[name] {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return nil, fmt.Errorf("--%s %q: want KEY=VALUE", name, kv)
		}
		out[k] = v
	}
	return out, nil
}

// entry is one file of the layer.
type entry struct {
	dest string // absolute path in the image
	mode int64
	src  string
}

func build(args []string) error {
	f, positional, err := parseFlags(args, "output", "file", "tree", "user", "entrypoint", "cmd",
		"env", "label", "created", "ref-name", "platform", "workdir", "comment")
	if err != nil {
		return err
	}
	if len(positional) > 0 {
		return fmt.Errorf("unexpected arguments %q", positional)
	}
	output := f.one("output")
	if output == "" {
		return errors.New("build: -o OUT.oci.tar is required")
	}
	epoch, err := strconv.ParseInt(f.one("created"), 10, 64)
	if err != nil {
		return fmt.Errorf("--created %q: seconds since 1970 (SOURCE_DATE_EPOCH): %w", f.one("created"), err)
	}
	created := time.Unix(epoch, 0).UTC()

	var entries []entry
	for _, spec := range f["file"] {
		parts := strings.SplitN(spec, ":", 3)
		if len(parts) != 3 || !path.IsAbs(parts[0]) {
			return fmt.Errorf("--file %q: want /DEST:MODE:SRC", spec)
		}
		mode, err := strconv.ParseInt(parts[1], 8, 64)
		if err != nil {
			return fmt.Errorf("--file %q: mode %q is not octal: %w", spec, parts[1], err)
		}
		entries = append(entries, entry{dest: path.Clean(parts[0]), mode: mode, src: parts[2]})
	}
	for _, dir := range f["tree"] {
		tree, err := treeEntries(dir)
		if err != nil {
			return err
		}
		entries = append(entries, tree...)
	}
	layerTar, err := layerTar(entries, created)
	if err != nil {
		return err
	}
	compressed, err := gzipped(layerTar)
	if err != nil {
		return err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(compressed)), nil
	}, tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return fmt.Errorf("reading the layer back: %w", err)
	}

	env := f["env"]
	labels, err := f.keyValues("label")
	if err != nil {
		return err
	}
	platform, err := v1.ParsePlatform(orDefault(f.one("platform"), "linux/amd64"))
	if err != nil {
		return fmt.Errorf("--platform: %w", err)
	}
	config := v1.Config{
		User:       f.one("user"),
		Entrypoint: f["entrypoint"],
		Cmd:        f["cmd"],
		Env:        env,
		Labels:     labels,
		WorkingDir: orDefault(f.one("workdir"), "/"),
	}
	img := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	img, err = mutate.Append(img, mutate.Addendum{
		Layer: layer,
		History: v1.History{
			Created:   v1.Time{Time: created},
			CreatedBy: "oci-image build (make image)",
			Comment:   orDefault(f.one("comment"), "the gpu-operator binary, CA certificates, passwd/group, licence"),
		},
	})
	if err != nil {
		return fmt.Errorf("adding the layer: %w", err)
	}
	cfg, err := img.ConfigFile()
	if err != nil {
		return err
	}
	cfg = cfg.DeepCopy()
	cfg.Config = config
	cfg.Created = v1.Time{Time: created}
	cfg.OS, cfg.Architecture, cfg.Variant = platform.OS, platform.Architecture, platform.Variant
	img, err = mutate.ConfigFile(img, cfg)
	if err != nil {
		return fmt.Errorf("setting the config: %w", err)
	}
	dir, err := os.MkdirTemp(filepath.Dir(output), ".oci-layout-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	lp, err := layout.Write(dir, empty.Index)
	if err != nil {
		return fmt.Errorf("writing the OCI layout: %w", err)
	}
	var annotations map[string]string
	if ref := f.one("ref-name"); ref != "" {
		annotations = map[string]string{refNameAnnotation: ref}
	}
	if err := lp.AppendImage(img, layout.WithAnnotations(annotations), layout.WithPlatform(*platform)); err != nil {
		return fmt.Errorf("writing the image into the layout: %w", err)
	}
	digest, err := img.Digest()
	if err != nil {
		return err
	}
	// What was written, read back as a consumer reads it: every digest, size and diff ID.
	written, err := lp.Image(digest)
	if err != nil {
		return fmt.Errorf("reading the image back from the layout: %w", err)
	}
	if err := validate.Image(written); err != nil {
		return fmt.Errorf("the image just written is invalid: %w", err)
	}
	if err := writeArchive(dir, output, created); err != nil {
		return err
	}
	fmt.Println(digest.String())
	return nil
}

func orDefault(v, d string) string {
	if v == "" {
		return d
	}
	return v
}

// treeEntries lists the regular files under dir as entries at the same path under "/": mode 0755
// when the owner may execute the file, else 0644 (so a checkout's umask does not matter).
func treeEntries(dir string) ([]entry, error) {
	var out []entry
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			return nil
		}
		if !d.Type().IsRegular() {
			return fmt.Errorf("%s: only regular files may go into the image", p)
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil {
			return err
		}
		mode := int64(0o644)
		if info.Mode().Perm()&0o100 != 0 {
			mode = 0o755
		}
		out = append(out, entry{dest: "/" + filepath.ToSlash(rel), mode: mode, src: p})
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", dir, err)
	}
	return out, nil
}

// layerTar writes the entries and their parent folders (0755) as a tar, sorted by path, owned
// by 0:0, every mtime the build time.
func layerTar(entries []entry, mtime time.Time) ([]byte, error) {
	files := map[string]entry{}
	dirs := map[string]bool{}
	for _, e := range entries {
		if _, dup := files[e.dest]; dup {
			return nil, fmt.Errorf("%s is given twice", e.dest)
		}
		files[e.dest] = e
		for d := path.Dir(e.dest); d != "/"; d = path.Dir(d) {
			dirs[d] = true
		}
	}
	var names []string
	for d := range dirs {
		if _, clash := files[d]; clash {
			return nil, fmt.Errorf("%s is both a file and a folder", d)
		}
		names = append(names, d)
	}
	for name := range files {
		names = append(names, name)
	}
	sort.Strings(names)

	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, name := range names {
		hdr := &tar.Header{
			Name:    strings.TrimPrefix(name, "/"),
			ModTime: mtime,
			Format:  tar.FormatPAX,
		}
		if dirs[name] {
			hdr.Typeflag, hdr.Name, hdr.Mode = tar.TypeDir, hdr.Name+"/", 0o755
			if err := tw.WriteHeader(hdr); err != nil {
				return nil, err
			}
			continue
		}
		e := files[name]
		data, err := os.ReadFile(e.src)
		if err != nil {
			return nil, fmt.Errorf("reading %s for %s: %w", e.src, name, err)
		}
		hdr.Typeflag, hdr.Mode, hdr.Size = tar.TypeReg, e.mode, int64(len(data))
		if err := tw.WriteHeader(hdr); err != nil {
			return nil, err
		}
		if _, err := tw.Write(data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// gzipped compresses with no name and no time in the header.
func gzipped(data []byte) ([]byte, error) {
	var buf bytes.Buffer
	zw, err := gzip.NewWriterLevel(&buf, gzip.BestCompression)
	if err != nil {
		return nil, err
	}
	if _, err := zw.Write(data); err != nil {
		return nil, err
	}
	if err := zw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// writeArchive tars the layout folder (sorted, 0:0, fixed mtimes) into output, through a
// temporary file renamed into place.
func writeArchive(dir, output string, mtime time.Time) error {
	var names []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if p != dir {
			names = append(names, p)
		}
		return nil
	})
	if err != nil {
		return err
	}
	sort.Strings(names)
	tmp, err := os.CreateTemp(filepath.Dir(output), ".oci-archive-")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	tw := tar.NewWriter(tmp)
	for _, p := range names {
		rel, err := filepath.Rel(dir, p)
		if err != nil {
			return err
		}
		info, err := os.Lstat(p)
		if err != nil {
			return err
		}
		hdr := &tar.Header{Name: filepath.ToSlash(rel), ModTime: mtime, Format: tar.FormatPAX}
		if info.IsDir() {
			hdr.Typeflag, hdr.Name, hdr.Mode = tar.TypeDir, hdr.Name+"/", 0o755
			if err := tw.WriteHeader(hdr); err != nil {
				return err
			}
			continue
		}
		data, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		hdr.Typeflag, hdr.Mode, hdr.Size = tar.TypeReg, 0o644, int64(len(data))
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if _, err := tw.Write(data); err != nil {
			return err
		}
	}
	if err := tw.Close(); err != nil {
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), output)
}

// ---- check ----

// summary is what check prints, as JSON.
type summary struct {
	Archive      string            `json:"archive"`
	RefName      string            `json:"refName"`
	Digest       string            `json:"digest"`
	MediaType    string            `json:"mediaType"`
	ConfigDigest string            `json:"configDigest"`
	Platform     string            `json:"platform"`
	Created      string            `json:"created"`
	User         string            `json:"user"`
	Entrypoint   []string          `json:"entrypoint"`
	Cmd          []string          `json:"cmd"`
	Env          []string          `json:"env"`
	WorkingDir   string            `json:"workingDir"`
	Labels       map[string]string `json:"labels"`
	Layers       []layerSummary    `json:"layers"`
	// Compressed size of the image: config and layers.
	Size int64 `json:"size"`
}

type layerSummary struct {
	Digest    string   `json:"digest"`
	MediaType string   `json:"mediaType"`
	Size      int64    `json:"size"`
	Files     []string `json:"files"`
}

func check(args []string) error {
	f, positional, err := parseFlags(args, "user", "entrypoint", "label", "require-label",
		"absent", "static", "extract", "rootfs")
	if err != nil {
		return err
	}
	if len(positional) != 1 {
		return errors.New("check: one archive, please")
	}
	archive := positional[0]
	dir, err := os.MkdirTemp("", "oci-image-check-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	if err := untar(archive, dir); err != nil {
		return fmt.Errorf("%s is not a tar of an OCI layout: %w", archive, err)
	}
	if _, err := os.Stat(filepath.Join(dir, "oci-layout")); err != nil {
		return fmt.Errorf("%s: no oci-layout file: %w", archive, err)
	}
	index, err := layout.ImageIndexFromPath(dir)
	if err != nil {
		return fmt.Errorf("%s: reading index.json: %w", archive, err)
	}
	manifest, err := index.IndexManifest()
	if err != nil {
		return fmt.Errorf("%s: index.json: %w", archive, err)
	}
	if len(manifest.Manifests) != 1 {
		return fmt.Errorf("%s: index.json names %d manifests, want one image", archive, len(manifest.Manifests))
	}
	desc := manifest.Manifests[0]
	if desc.MediaType != types.OCIManifestSchema1 {
		return fmt.Errorf("%s: manifest media type %s, want %s", archive, desc.MediaType, types.OCIManifestSchema1)
	}
	img, err := index.Image(desc.Digest)
	if err != nil {
		return fmt.Errorf("%s: manifest %s: %w", archive, desc.Digest, err)
	}
	if err := validate.Image(img); err != nil {
		return fmt.Errorf("%s: %w", archive, err)
	}
	m, err := img.Manifest()
	if err != nil {
		return err
	}
	if m.Config.MediaType != types.OCIConfigJSON {
		return fmt.Errorf("config media type %s, want %s", m.Config.MediaType, types.OCIConfigJSON)
	}
	cfg, err := img.ConfigFile()
	if err != nil {
		return err
	}
	s := summary{
		Archive:      archive,
		RefName:      desc.Annotations[refNameAnnotation],
		Digest:       desc.Digest.String(),
		MediaType:    string(desc.MediaType),
		ConfigDigest: m.Config.Digest.String(),
		Platform:     cfg.Platform().String(),
		Created:      cfg.Created.UTC().Format(time.RFC3339),
		User:         cfg.Config.User,
		Entrypoint:   cfg.Config.Entrypoint,
		Cmd:          cfg.Config.Cmd,
		Env:          cfg.Config.Env,
		WorkingDir:   cfg.Config.WorkingDir,
		Labels:       cfg.Config.Labels,
		Size:         m.Config.Size,
	}
	extract, err := f.keyValues("extract")
	if err != nil {
		return err
	}
	contents := map[string][]byte{}
	layers, err := img.Layers()
	if err != nil {
		return err
	}
	for _, layer := range layers {
		ls, err := readLayer(layer, extract, contents, f.one("rootfs"))
		if err != nil {
			return err
		}
		s.Layers = append(s.Layers, ls)
		s.Size += ls.Size
	}
	out, err := json.MarshalIndent(s, "", "  ")
	if err != nil {
		return err
	}
	fmt.Println(string(out))

	var problems []string
	problem := func(format string, a ...any) { problems = append(problems, fmt.Sprintf(format, a...)) }
	if want := f.one("user"); want != "" && s.User != want {
		problem("user is %q, want %q", s.User, want)
	}
	if strings.HasPrefix(s.User, "0") || s.User == "" || strings.HasPrefix(s.User, "root") {
		problem("user %q is root or empty: the image must run as a non-root user", s.User)
	}
	if want := f["entrypoint"]; len(want) > 0 && strings.Join(s.Entrypoint, "\x00") != strings.Join(want, "\x00") {
		problem("entrypoint is %q, want %q", s.Entrypoint, want)
	}
	wantLabels, err := f.keyValues("label")
	if err != nil {
		return err
	}
	for k, v := range wantLabels {
		if got, ok := s.Labels[k]; !ok || got != v {
			problem("label %s is %q, want %q", k, got, v)
		}
	}
	for _, k := range f["require-label"] {
		if s.Labels[k] == "" {
			problem("label %s is missing or empty", k)
		}
	}
	all := map[string]bool{}
	for _, l := range s.Layers {
		for _, line := range l.Files {
			name, _, _ := strings.Cut(line, " ")
			all["/"+strings.TrimSuffix(name, "/")] = true
		}
	}
	for _, p := range f["absent"] {
		if all[p] {
			problem("%s is in the image, but must not be", p)
		}
	}
	for imagePath, file := range extract {
		data, ok := contents[imagePath]
		if !ok {
			problem("%s is not a regular file of the image", imagePath)
			continue
		}
		if err := os.WriteFile(file, data, 0o755); err != nil {
			return fmt.Errorf("extracting %s: %w", imagePath, err)
		}
	}
	for _, p := range f["static"] {
		data, ok := contents[p]
		if !ok {
			problem("%s is not in the image (pass it to --extract to check it is static)", p)
			continue
		}
		if err := isStatic(data); err != nil {
			problem("%s: %v", p, err)
		}
	}
	if len(problems) > 0 {
		return fmt.Errorf("%s does not pass:\n  %s", archive, strings.Join(problems, "\n  "))
	}
	return nil
}

// readLayer lists a layer's entries and keeps the contents of the files named in want. With a
// rootfs folder, it also unpacks the layer's folders and regular files there (with their modes),
// so the caller can run the image's binary inside the image's own file system.
func readLayer(layer v1.Layer, want map[string]string, contents map[string][]byte, rootfs string) (layerSummary, error) {
	digest, err := layer.Digest()
	if err != nil {
		return layerSummary{}, err
	}
	mt, err := layer.MediaType()
	if err != nil {
		return layerSummary{}, err
	}
	size, err := layer.Size()
	if err != nil {
		return layerSummary{}, err
	}
	ls := layerSummary{Digest: digest.String(), MediaType: string(mt), Size: size}
	rc, err := layer.Uncompressed()
	if err != nil {
		return ls, err
	}
	defer rc.Close()
	tr := tar.NewReader(rc)
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return ls, fmt.Errorf("layer %s: %w", digest, err)
		}
		// "path mode uid:gid size", as `tar -tv` would show it.
		ls.Files = append(ls.Files, fmt.Sprintf("%s %04o %d:%d %d", hdr.Name, hdr.Mode, hdr.Uid, hdr.Gid, hdr.Size))
		p := "/" + strings.TrimSuffix(hdr.Name, "/")
		if strings.Contains(p, "/../") || strings.HasSuffix(p, "/..") {
			return ls, fmt.Errorf("layer %s: entry %q leaves the file system", digest, hdr.Name)
		}
		var data []byte
		if hdr.Typeflag == tar.TypeReg {
			if data, err = io.ReadAll(tr); err != nil {
				return ls, err
			}
			if _, ok := want[p]; ok {
				contents[p] = data
			}
		}
		if rootfs != "" {
			target := filepath.Join(rootfs, filepath.FromSlash(p))
			switch hdr.Typeflag {
			case tar.TypeDir:
				err = os.MkdirAll(target, os.FileMode(hdr.Mode).Perm())
			case tar.TypeReg:
				if err = os.MkdirAll(filepath.Dir(target), 0o755); err == nil {
					err = os.WriteFile(target, data, os.FileMode(hdr.Mode).Perm())
				}
			default:
				err = fmt.Errorf("entry %q: type %c is not unpacked", hdr.Name, hdr.Typeflag)
			}
			if err != nil {
				return ls, fmt.Errorf("unpacking into %s: %w", rootfs, err)
			}
		}
	}
	return ls, nil
}

// isStatic reports why an ELF executable would need a dynamic loader or shared libraries.
func isStatic(data []byte) error {
	f, err := elf.NewFile(bytes.NewReader(data))
	if err != nil {
		return fmt.Errorf("not an ELF file: %w", err)
	}
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return errors.New("has a program interpreter (dynamically linked)")
		}
	}
	libs, err := f.ImportedLibraries()
	if err == nil && len(libs) > 0 {
		return fmt.Errorf("needs shared libraries %v", libs)
	}
	return nil
}

// untar extracts an archive of regular files and folders into dir, refusing paths that leave it.
func untar(archive, dir string) error {
	file, err := os.Open(archive)
	if err != nil {
		return err
	}
	defer file.Close()
	tr := tar.NewReader(file)
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		name := filepath.Clean(hdr.Name)
		if filepath.IsAbs(name) || name == ".." || strings.HasPrefix(name, "../") {
			return fmt.Errorf("entry %q leaves the archive", hdr.Name)
		}
		target := filepath.Join(dir, name)
		switch hdr.Typeflag {
		case tar.TypeDir:
			if err := os.MkdirAll(target, 0o755); err != nil {
				return err
			}
		case tar.TypeReg:
			if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
				return err
			}
			out, err := os.Create(target)
			if err != nil {
				return err
			}
			if _, err := io.Copy(out, tr); err != nil {
				out.Close()
				return err
			}
			if err := out.Close(); err != nil {
				return err
			}
		default:
			return fmt.Errorf("entry %q: unexpected type %c", hdr.Name, hdr.Typeflag)
		}
	}
}
