// Command probe checks a pod's in-cluster access the way a client library's in-cluster
// configuration does: with the pod's ServiceAccount token and the cluster CA it posts a
// SelfSubjectReview to the apiserver at the `kubernetes` Service
// ($KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT) and prints the answer, which names
// the pod's identity. With -serve TEXT it then serves TEXT on :8080, so that a test can
// reach the pod by its IP.
//
// The local fleet builds it (standard library only, static) into the image
// kmm-fleet/probe for its real nodes.
package main

import (
	"crypto/tls"
	"crypto/x509"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"time"
)

const (
	serviceAccount = "/var/run/secrets/kubernetes.io/serviceaccount/"
	review         = `{"apiVersion":"authentication.k8s.io/v1","kind":"SelfSubjectReview"}`
	// A probe may start before its node's kube-proxy has written the rules for the
	// `kubernetes` Service; it waits up to this many seconds for them.
	attempts = 60
)

func main() {
	serve := flag.String("serve", "", "after the review, serve this text on :8080")
	flag.Parse()

	answer, err := whoAmI()
	if err != nil {
		fmt.Fprintln(os.Stderr, "probe:", err)
		os.Exit(1)
	}
	fmt.Println(answer)
	if *serve == "" {
		return
	}
	handler := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintln(w, *serve)
	})
	if err := http.ListenAndServe(":8080", handler); err != nil {
		fmt.Fprintln(os.Stderr, "probe:", err)
		os.Exit(1)
	}
}

// whoAmI posts the SelfSubjectReview, retrying once a second until the `kubernetes`
// Service routes.
func whoAmI() (string, error) {
	token, err := os.ReadFile(serviceAccount + "token")
	if err != nil {
		return "", err
	}
	ca, err := os.ReadFile(serviceAccount + "ca.crt")
	if err != nil {
		return "", err
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(ca) {
		return "", fmt.Errorf("no certificate in %sca.crt", serviceAccount)
	}
	client := &http.Client{
		Timeout:   10 * time.Second,
		Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}},
	}
	host := net.JoinHostPort(os.Getenv("KUBERNETES_SERVICE_HOST"), os.Getenv("KUBERNETES_SERVICE_PORT"))
	url := "https://" + host + "/apis/authentication.k8s.io/v1/selfsubjectreviews"
	for attempt := 1; ; attempt++ {
		answer, err := post(client, url, strings.TrimSpace(string(token)))
		if err == nil || attempt == attempts {
			return answer, err
		}
		fmt.Fprintf(os.Stderr, "probe: attempt %d: %v\n", attempt, err)
		time.Sleep(time.Second)
	}
}

func post(client *http.Client, url, token string) (string, error) {
	request, err := http.NewRequest(http.MethodPost, url, strings.NewReader(review))
	if err != nil {
		return "", err
	}
	request.Header.Set("Authorization", "Bearer "+token)
	request.Header.Set("Content-Type", "application/json")
	response, err := client.Do(request)
	if err != nil {
		return "", err
	}
	defer response.Body.Close()
	body, err := io.ReadAll(response.Body)
	if err != nil {
		return "", err
	}
	if response.StatusCode != http.StatusCreated {
		return "", fmt.Errorf("%s: %s", response.Status, body)
	}
	return string(body), nil
}
