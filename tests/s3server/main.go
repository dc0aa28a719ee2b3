// s3server: an S3-compatible server on loopback for the weight-fetch tests.
//
// It serves gofakes3's in-memory backend (MIT) with AWS Signature V4 checked against one
// access key, so a wrong credential is refused as a real bucket would refuse it. Each
// -seed bucket=DIR creates the bucket and uploads every file under DIR (key: the path
// relative to DIR). It prints "listening on HOST:PORT" once it accepts requests.
package main

import (
	"context"
	"flag"
	"fmt"
	"io/fs"
	"log"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"

	"github.com/rclone/gofakes3"
	"github.com/rclone/gofakes3/s3mem"
)

type seeds []string

func (s *seeds) String() string     { return strings.Join(*s, ",") }
func (s *seeds) Set(v string) error { *s = append(*s, v); return nil }

func seed(ctx context.Context, backend *s3mem.Backend, spec string) error {
	bucket, dir, ok := strings.Cut(spec, "=")
	if !ok {
		return fmt.Errorf("-seed wants bucket=DIR, got %q", spec)
	}
	if err := backend.CreateBucket(ctx, bucket); err != nil {
		return err
	}
	return filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, err := filepath.Rel(dir, path)
		if err != nil {
			return err
		}
		f, err := os.Open(path)
		if err != nil {
			return err
		}
		defer f.Close()
		info, err := f.Stat()
		if err != nil {
			return err
		}
		_, err = backend.PutObject(ctx, bucket, filepath.ToSlash(rel), map[string]string{}, f,
			info.Size())
		return err
	})
}

func main() {
	addr := flag.String("addr", "127.0.0.1:0", "listen address")
	accessKey := flag.String("access-key", "", "the one access key id accepted")
	secretKey := flag.String("secret-key", "", "its secret")
	var buckets seeds
	flag.Var(&buckets, "seed", "bucket=DIR: create bucket and upload DIR into it (repeatable)")
	flag.Parse()
	if *accessKey == "" || *secretKey == "" {
		log.Fatal("-access-key and -secret-key are required")
	}
	ctx := context.Background()
	backend := s3mem.New()
	for _, spec := range buckets {
		if err := seed(ctx, backend, spec); err != nil {
			log.Fatalf("seeding %s: %v", spec, err)
		}
	}
	server := gofakes3.New(backend, gofakes3.WithV4Auth(map[string]string{*accessKey: *secretKey}))
	listener, err := net.Listen("tcp", *addr)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("listening on %s\n", listener.Addr())
	log.Fatal(http.Serve(listener, server.Server()))
}
