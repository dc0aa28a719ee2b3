module tessera.dev/tests/s3server

go 1.24.0

require github.com/rclone/gofakes3 v0.0.12

require (
	github.com/minio/xxml v0.0.3 // indirect
	github.com/ryszard/goskiplist v0.0.0-20150312221310-2dfbae5fcf46 // indirect
	github.com/shabbyrobe/gocovmerge v0.0.0-20230507112040-c3350d9342df // indirect
	golang.org/x/tools v0.40.0 // indirect
)
