package main

import (
	"context"
	"fmt"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/opentinker/opentinker/gen/go/opentinker/v1"
)

// errorInfo returns the google.rpc.ErrorInfo detail of a failed call, if it carries one.
func errorInfo(err error) (*status.Status, *errdetails.ErrorInfo) {
	st, _ := status.FromError(err)
	for _, detail := range st.Details() {
		if info, ok := detail.(*errdetails.ErrorInfo); ok {
			return st, info
		}
	}
	return st, nil
}

// expectError makes a call that must fail with the given code and prints what the ErrorInfo says.
func expectError(what string, err error, want codes.Code) error {
	if err == nil {
		return fmt.Errorf("%s succeeded; want %s", what, want)
	}
	st, info := errorInfo(err)
	if st.Code() != want {
		return fmt.Errorf("%s: got %s, want %s: %w", what, st.Code(), want, err)
	}
	if info == nil {
		return fmt.Errorf("%s: %s without a google.rpc.ErrorInfo detail", what, st.Code())
	}
	fmt.Printf("error %s code %s reason %s domain %s metadata %v message %q\n",
		what, st.Code(), info.GetReason(), info.GetDomain(), info.GetMetadata(), st.Message())
	return nil
}

// showErrors makes two deliberately bad calls, one per kind of server, and decodes their error details.
func showErrors(ctx context.Context, registry pb.RegistryServiceClient, trainer pb.TrainerServiceClient, adapter string) error {
	// The step above consumed the gradients: a second OptimStep has nothing to apply.
	_, err := trainer.OptimStep(ctx, &pb.OptimStepRequest{Adapter: adapter})
	if err := expectError("OptimStep", err, codes.FailedPrecondition); err != nil {
		return err
	}
	_, err = registry.GetVersion(ctx, &pb.GetVersionRequest{Adapter: adapter, Version: 1 << 40})
	return expectError("GetVersion", err, codes.NotFound)
}
