// Command pod-sandbox runs one program the way a kubelet runs a container, for the harness,
// which has no container runtime: in its own network namespace (so a server binding every
// address is reachable from nowhere) and its own mount namespace, chrooted into a prepared
// root folder with the pod's volumes bind mounted and /proc mounted. The API server is reached
// from inside at 127.0.0.1:<port> through a unix socket: inside, a TCP listener forwards to
// the socket; outside, this process forwards the socket to the API server.
//
//	pod-sandbox -root DIR -api-port PORT -socket PATH [-user UID:GID] [-bind SRC:DST[:ro]]...
//	    -- PROGRAM ARGS...
//
// PROGRAM runs as UID:GID when given (the image's USER), else as root. It is looked up in the
// root's /usr/local/bin, /usr/bin and /bin unless it is a path, and gets this process's
// environment. SIGTERM and SIGINT are passed on; the exit status is the
// program's. Linux only, as root.
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
	"unsafe"
)

// innerEnv marks the re-executed copy of this program that runs inside the new namespaces.
const innerEnv = "POD_SANDBOX_INNER"

type binds []string

func (b *binds) String() string     { return strings.Join(*b, ",") }
func (b *binds) Set(v string) error { *b = append(*b, v); return nil }

type options struct {
	root    string
	apiPort int
	socket  string
	binds   binds
	user    string
	program []string
}

func parse(args []string) (*options, error) {
	o := &options{}
	fs := flag.NewFlagSet("pod-sandbox", flag.ContinueOnError)
	fs.StringVar(&o.root, "root", "", "prepared root folder the program is chrooted into")
	fs.IntVar(&o.apiPort, "api-port", 0, "API server port on 127.0.0.1, outside and inside")
	fs.StringVar(&o.socket, "socket", "", "unix socket path joining the two sides")
	fs.StringVar(&o.user, "user", "", "UID:GID to run the program as")
	fs.Var(&o.binds, "bind", "SRC:DST[:ro], DST inside the root (repeatable)")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	o.program = fs.Args()
	switch {
	case o.root == "":
		return nil, errors.New("-root is required")
	case o.apiPort <= 0:
		return nil, errors.New("-api-port is required")
	case o.socket == "":
		return nil, errors.New("-socket is required")
	case len(o.program) == 0:
		return nil, errors.New("no program given after --")
	}
	return o, nil
}

func main() {
	o, err := parse(os.Args[1:])
	if err != nil {
		fmt.Fprintf(os.Stderr, "pod-sandbox: %v\n", err)
		os.Exit(2)
	}
	if os.Getenv(innerEnv) != "" {
		os.Unsetenv(innerEnv)
		err = inner(o)
	} else {
		err = outer(o)
	}
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		os.Exit(exit.ExitCode())
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "pod-sandbox: %v\n", err)
		os.Exit(1)
	}
}

// forward copies both ways between two connections until either side closes.
func forward(a, b net.Conn) {
	done := make(chan struct{}, 2)
	cp := func(dst, src net.Conn) {
		_, _ = io.Copy(dst, src)
		if c, ok := dst.(interface{ CloseWrite() error }); ok {
			_ = c.CloseWrite()
		}
		done <- struct{}{}
	}
	go cp(a, b)
	go cp(b, a)
	<-done
	<-done
	a.Close()
	b.Close()
}

// serve accepts on l and joins every connection to a new one from dial.
func serve(l net.Listener, dial func() (net.Conn, error)) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		go func() {
			up, err := dial()
			if err != nil {
				fmt.Fprintf(os.Stderr, "pod-sandbox: forwarding: %v\n", err)
				c.Close()
				return
			}
			forward(c, up)
		}()
	}
}

// run starts cmd and waits for it, passing SIGTERM and SIGINT on.
func run(cmd *exec.Cmd) error {
	signals := make(chan os.Signal, 2)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("starting %s: %w", cmd.Path, err)
	}
	go func() {
		for s := range signals {
			_ = cmd.Process.Signal(s)
		}
	}()
	return cmd.Wait()
}

// outer runs in the caller's namespaces: serves the socket, then runs the inner copy in new
// network and mount namespaces (killed if this process dies).
func outer(o *options) error {
	_ = os.Remove(o.socket)
	l, err := net.Listen("unix", o.socket)
	if err != nil {
		return fmt.Errorf("listening on %s: %w", o.socket, err)
	}
	defer l.Close()
	api := net.JoinHostPort("127.0.0.1", strconv.Itoa(o.apiPort))
	go serve(l, func() (net.Conn, error) { return net.Dial("tcp", api) })

	self, err := os.Executable()
	if err != nil {
		return err
	}
	cmd := exec.Command(self, os.Args[1:]...)
	cmd.Env = append(os.Environ(), innerEnv+"=1")
	cmd.Stdin, cmd.Stdout, cmd.Stderr = nil, os.Stdout, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags: syscall.CLONE_NEWNET | syscall.CLONE_NEWNS,
		Pdeathsig:  syscall.SIGKILL,
	}
	go exitWithParent()
	return run(cmd)
}

// exitWithParent ends this process (and so, by their parent-death signal, the program and
// the inner copy) when whoever started it is gone: a test killed outright leaves no NFD behind.
func exitWithParent() {
	parent := os.Getppid()
	for range time.Tick(time.Second) {
		if os.Getppid() != parent {
			fmt.Fprintln(os.Stderr, "pod-sandbox: the process that started it is gone; exiting")
			os.Exit(1)
		}
	}
}

// inner runs in the new namespaces: loopback up, volumes mounted, the API forwarder listening,
// then the program chrooted into the root.
func inner(o *options) error {
	if err := loopbackUp(); err != nil {
		return fmt.Errorf("bringing lo up: %w", err)
	}
	// Nothing mounted here may propagate back to the host.
	if err := syscall.Mount("", "/", "", syscall.MS_REC|syscall.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("making mounts private: %w", err)
	}
	for _, b := range o.binds {
		if err := bindMount(o.root, b); err != nil {
			return err
		}
	}
	// As a container runtime does (no PID namespace here, so it shows the host's processes).
	proc := filepath.Join(o.root, "proc")
	if err := os.MkdirAll(proc, 0o755); err != nil {
		return err
	}
	if err := syscall.Mount("proc", proc, "proc", syscall.MS_NOSUID|syscall.MS_NODEV|syscall.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("mounting /proc in %s: %w", o.root, err)
	}
	l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(o.apiPort)))
	if err != nil {
		return fmt.Errorf("listening for the API server inside: %w", err)
	}
	go serve(l, func() (net.Conn, error) { return net.Dial("unix", o.socket) })

	path, err := lookup(o.root, o.program[0])
	if err != nil {
		return err
	}
	cmd := &exec.Cmd{Path: path, Args: o.program, Env: os.Environ(), Dir: "/"}
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Chroot: o.root, Pdeathsig: syscall.SIGKILL}
	if o.user != "" {
		cred, err := credential(o.user)
		if err != nil {
			return err
		}
		cmd.SysProcAttr.Credential = cred
	}
	return run(cmd)
}

// credential parses UID:GID; the program gets no supplementary groups.
func credential(user string) (*syscall.Credential, error) {
	uid, gid, ok := strings.Cut(user, ":")
	u, errU := strconv.ParseUint(uid, 10, 32)
	g, errG := strconv.ParseUint(gid, 10, 32)
	if !ok || errU != nil || errG != nil {
		return nil, fmt.Errorf("-user %q: want UID:GID, numbers", user)
	}
	return &syscall.Credential{Uid: uint32(u), Gid: uint32(g), Groups: []uint32{}}, nil
}

// bindMount mounts SRC on ROOT/DST, read-only with the ":ro" suffix.
func bindMount(root, spec string) error {
	parts := strings.Split(spec, ":")
	if len(parts) < 2 || len(parts) > 3 || (len(parts) == 3 && parts[2] != "ro") {
		return fmt.Errorf("-bind %q: want SRC:DST or SRC:DST:ro", spec)
	}
	src, dst := parts[0], filepath.Join(root, parts[1])
	if err := syscall.Mount(src, dst, "", syscall.MS_BIND|syscall.MS_REC, ""); err != nil {
		return fmt.Errorf("bind mounting %s on %s (the mount point must exist): %w", src, dst, err)
	}
	if len(parts) == 3 {
		flags := uintptr(syscall.MS_BIND | syscall.MS_REMOUNT | syscall.MS_RDONLY)
		if err := syscall.Mount("", dst, "", flags, ""); err != nil {
			return fmt.Errorf("making %s read-only: %w", dst, err)
		}
	}
	return nil
}

// lookup finds the program inside the root as a container runtime would on its PATH.
func lookup(root, name string) (string, error) {
	if strings.Contains(name, "/") {
		return name, nil
	}
	for _, dir := range []string{"/usr/local/bin", "/usr/bin", "/bin"} {
		p := filepath.Join(dir, name)
		if st, err := os.Stat(filepath.Join(root, p)); err == nil && !st.IsDir() {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s not found in %s's /usr/local/bin, /usr/bin or /bin", name, root)
}

// loopbackUp sets IFF_UP on lo (a new network namespace starts with it down).
func loopbackUp() error {
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_DGRAM, 0)
	if err != nil {
		return err
	}
	defer syscall.Close(fd)
	var req [40]byte // struct ifreq: name[16], then the flags (short)
	copy(req[:], "lo")
	if _, _, e := syscall.Syscall(syscall.SYS_IOCTL, uintptr(fd), syscall.SIOCGIFFLAGS, uintptr(unsafe.Pointer(&req[0]))); e != 0 {
		return e
	}
	flags := (*uint16)(unsafe.Pointer(&req[16]))
	*flags |= syscall.IFF_UP
	if _, _, e := syscall.Syscall(syscall.SYS_IOCTL, uintptr(fd), syscall.SIOCSIFFLAGS, uintptr(unsafe.Pointer(&req[0]))); e != 0 {
		return e
	}
	return nil
}
