// Command netns-run runs a command in a network namespace of its own, where only the named
// loopback addresses lead out, each to the same address on the host:
//
//	netns-run --forward 127.0.0.1:PORT [--forward 127.0.0.1:PORT2 ...]
//	          [--publish 127.0.0.1:HOSTPORT=INNERPORT ...] -- COMMAND [ARGS...]
//
// It is for harness tools that bind every address on fixed ports (OLM's olm-operator serves
// metrics and health on :8080 and has no flag to change that): in their own namespace they bind
// nothing the host or other tests can see, and reach the API server through a forwarded port
// (the kubeconfig's https://127.0.0.1:PORT works unchanged, certificate included); OLM's catalog
// operator also reaches the catalog's gRPC server through a second one. --publish is the other
// direction, for a server that binds every address (`opm serve` listens on ":PORT"): the host's
// 127.0.0.1:HOSTPORT leads to 127.0.0.1:INNERPORT inside, so only loopback clients reach it.
// Needs root (CAP_SYS_ADMIN), as `unshare --net` does.
//
// How: the main goroutine is locked to its thread, which alone moves into a new network
// namespace (unshare(CLONE_NEWNET) acts on the calling thread), brings the loopback interface
// up, listens on the addresses and starts COMMAND, which inherits the namespace. Every other
// thread stays in the host's namespace (Go starts new threads from a template thread once one
// is locked), so the goroutines that dial the host side of each connection reach the host's
// 127.0.0.1. A published port's listener is made on such a thread (host side) and each
// connection dialed from the locked one (inside). COMMAND gets SIGKILL when this process dies;
// the exit code is COMMAND's.
package main

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

func fail(code int, format string, args ...any) {
	fmt.Fprintf(os.Stderr, "netns-run: "+format+"\n", args...)
	os.Exit(code)
}

// loopbackUp sets lo up in the calling thread's namespace: a fresh one has it down, and then
// nothing reaches 127.0.0.1.
func loopbackUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	req, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, req); err != nil {
		return err
	}
	req.SetUint16(req.Uint16() | unix.IFF_UP | unix.IFF_RUNNING)
	return unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, req)
}

// pipe copies one direction and then closes the other side's writing half.
func pipe(dst, src net.Conn) {
	_, _ = io.Copy(dst, src)
	if tcp, ok := dst.(*net.TCPConn); ok {
		_ = tcp.CloseWrite()
	}
}

func forward(inner net.Conn, target string) {
	defer inner.Close()
	outer, err := net.Dial("tcp", target)
	if err != nil {
		fmt.Fprintf(os.Stderr, "netns-run: dialing %s on the host: %v\n", target, err)
		return
	}
	defer outer.Close()
	done := make(chan struct{}, 2)
	go func() { pipe(outer, inner); done <- struct{}{} }()
	go func() { pipe(inner, outer); done <- struct{}{} }()
	<-done
	<-done
}

type dialResult struct {
	conn net.Conn
	err  error
}

type dialRequest struct {
	addr  string
	reply chan dialResult
}

// publish connects a host connection to addr inside the namespace, dialed by the locked thread.
func publish(outer net.Conn, addr string, dials chan<- dialRequest) {
	defer outer.Close()
	reply := make(chan dialResult, 1)
	dials <- dialRequest{addr, reply}
	res := <-reply
	if res.err != nil {
		fmt.Fprintf(os.Stderr, "netns-run: dialing %s in the namespace: %v\n", addr, res.err)
		return
	}
	inner := res.conn
	defer inner.Close()
	done := make(chan struct{}, 2)
	go func() { pipe(inner, outer); done <- struct{}{} }()
	go func() { pipe(outer, inner); done <- struct{}{} }()
	<-done
	<-done
}

func main() {
	args := os.Args[1:]
	var addrs []string
	published := map[string]string{}
	for len(args) >= 2 && (args[0] == "--forward" || args[0] == "--publish") {
		if args[0] == "--forward" {
			addrs = append(addrs, args[1])
		} else {
			hostAddr, innerPort, ok := strings.Cut(args[1], "=")
			if !ok {
				fail(2, "--publish %s: want 127.0.0.1:HOSTPORT=INNERPORT", args[1])
			}
			published[hostAddr] = net.JoinHostPort("127.0.0.1", innerPort)
			addrs = append(addrs, hostAddr)
		}
		args = args[2:]
	}
	if len(addrs) == 0 || len(args) < 2 || args[0] != "--" {
		fail(2, "usage: netns-run --forward 127.0.0.1:PORT [--forward ...] [--publish 127.0.0.1:HOSTPORT=INNERPORT ...] -- COMMAND [ARGS...]")
	}
	args = args[1:]
	for _, addr := range addrs {
		host, _, err := net.SplitHostPort(addr)
		if ip := net.ParseIP(host); err != nil || ip == nil || !ip.IsLoopback() {
			fail(2, "%s is not a loopback address and port", addr)
		}
	}
	// Published listeners belong to the host: made before this thread leaves its namespace,
	// like every thread Go starts later.
	dials := make(chan dialRequest)
	for hostAddr, inner := range published {
		listener, err := net.Listen("tcp", hostAddr)
		if err != nil {
			fail(1, "listening on %s on the host: %v", hostAddr, err)
		}
		go func() {
			for {
				conn, err := listener.Accept()
				if err != nil {
					return
				}
				go publish(conn, inner, dials)
			}
		}()
	}

	// This thread, and only it, moves; it is never unlocked, so it dies with the process.
	runtime.LockOSThread()
	if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
		fail(1, "unshare(CLONE_NEWNET): %v (needs root)", err)
	}
	if err := loopbackUp(); err != nil {
		fail(1, "bringing lo up: %v", err)
	}
	for _, addr := range addrs {
		if _, ok := published[addr]; ok {
			continue
		}
		// The socket is made on this thread, so it listens in the new namespace.
		listener, err := net.Listen("tcp", addr)
		if err != nil {
			fail(1, "listening on %s in the new namespace: %v", addr, err)
		}
		go func() {
			for {
				conn, err := listener.Accept()
				if err != nil {
					return
				}
				go forward(conn, addr)
			}
		}()
	}

	cmd := exec.Command(args[0], args[1:]...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		fail(1, "running %s: %v", args[0], err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	// This thread dials the inside end of published connections until COMMAND exits.
	var err error
wait:
	for {
		select {
		case req := <-dials:
			conn, dialErr := net.Dial("tcp", req.addr)
			req.reply <- dialResult{conn, dialErr}
		case err = <-exited:
			break wait
		}
	}
	var exit *exec.ExitError
	switch {
	case err == nil:
		os.Exit(0)
	case errors.As(err, &exit):
		if code := exit.ExitCode(); code >= 0 {
			os.Exit(code)
		}
		os.Exit(1)
	default:
		fail(1, "running %s: %v", args[0], err)
	}
}
