// Command etcd is the etcd server, built from the published go.etcd.io/etcd/server/v3
// module because etcd's own main package lives in an unpublished module.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
