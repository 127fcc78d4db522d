package rpc_test

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"math/big"
	"net"
	"testing"
	"time"

	"google.golang.org/grpc/credentials"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/rpc"
)

// testPKI is a certificate authority with a server and a client
// certificate, made fresh for each test.
type testPKI struct {
	pool           *x509.CertPool
	server, client tls.Certificate
}

func newPKI(t *testing.T) *testPKI {
	t.Helper()
	key := func() *ecdsa.PrivateKey {
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	caKey := key()
	caTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "tensorrpc test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, KeyUsage: x509.KeyUsageCertSign, BasicConstraintsValid: true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	ca, _ := x509.ParseCertificate(caDER)
	leaf := func(serial int64, usage x509.ExtKeyUsage) tls.Certificate {
		k := key()
		tmpl := &x509.Certificate{
			SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: "tensorrpc test"},
			NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
			KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{usage},
			IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &k.PublicKey, caKey)
		if err != nil {
			t.Fatal(err)
		}
		return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: k}
	}
	p := &testPKI{pool: x509.NewCertPool(), server: leaf(2, x509.ExtKeyUsageServerAuth), client: leaf(3, x509.ExtKeyUsageClientAuth)}
	p.pool.AddCert(ca)
	return p
}

func TestTLS(t *testing.T) {
	pki := newPKI(t)
	for _, mutual := range []bool{false, true} {
		name := "tls"
		if mutual {
			name = "mtls"
		}
		t.Run(name, func(t *testing.T) {
			serverConf := &tls.Config{Certificates: []tls.Certificate{pki.server}}
			clientConf := &tls.Config{RootCAs: pki.pool}
			if mutual {
				serverConf.ClientAuth = tls.RequireAndVerifyClientCert
				serverConf.ClientCAs = pki.pool
				clientConf.Certificates = []tls.Certificate{pki.client}
			}
			s, c := pair(t, rpc.TransportTCP,
				[]rpc.ServerOption{rpc.WithCreds(credentials.NewTLS(serverConf))},
				[]rpc.DialOption{rpc.WithTransportCredentials(credentials.NewTLS(clientConf))})
			in := wrapped(t, 1<<20, 4)
			s.Publish(context.Background(), "x", in)
			got, err := c.Fetch(ctxT(t), "x")
			if err != nil {
				t.Fatal(err)
			}
			defer got.Release()
			if !bytes.Equal(got.Bytes(), in.Bytes()) {
				t.Fatal("data differs")
			}
		})
	}
	t.Run("mtls-without-client-cert", func(t *testing.T) {
		serverConf := &tls.Config{Certificates: []tls.Certificate{pki.server}, ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: pki.pool}
		s, err := rpc.NewServer(rpc.WithTransports(rpc.TransportTCP, rpc.TransportGRPC), testPool(), rpc.WithCreds(credentials.NewTLS(serverConf)))
		if err != nil {
			t.Fatal(err)
		}
		lis := listen(t)
		served := make(chan error, 1)
		go func() { served <- s.Serve(lis) }()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		c, err := rpc.Dial(ctx, lis.Addr().String(), testPool(), rpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: pki.pool})))
		if err == nil {
			c.Close()
			t.Fatal("a client without a certificate opened a session")
		}
		s.Stop()
		<-served
		leakcheck.Check(t)
	})
}
