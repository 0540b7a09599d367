package dlrmkit.oip;

import com.google.gson.JsonObject;
import io.netty.channel.ChannelHandlerContext;
import io.netty.handler.codec.http.FullHttpRequest;
import io.netty.handler.codec.http.HttpMethod;
import io.netty.handler.codec.http.HttpResponseStatus;
import io.netty.handler.codec.http.HttpUtil;
import java.lang.reflect.Field;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import java.util.Map;
import java.util.concurrent.AbstractExecutorService;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.RunnableFuture;
import java.util.concurrent.TimeUnit;
import org.pytorch.serve.metrics.IMetric;
import org.pytorch.serve.metrics.MetricCache;
import org.pytorch.serve.util.ApiUtils;
import org.pytorch.serve.util.ConfigManager;
import org.pytorch.serve.util.NettyUtils;
import org.pytorch.serve.util.messages.InputParameter;
import org.pytorch.serve.util.messages.RequestInput;
import org.pytorch.serve.wlm.Model;
import org.pytorch.serve.wlm.ModelManager;
import org.pytorch.serve.wlm.WorkLoadManager;

/**
 * POST /v2/models/{m}[/versions/{v}]/infer|explain on TorchServe's own path: a RestJob on the
 * model's queue, answered by the worker straight to the channel, as InferenceRequestHandler's
 * /v2 route does, on the same event-loop thread and with no extra hop.
 *
 * <p>Why an executor: TorchServe runs a plugin's doPost later on its cached pool
 * (HttpRequestHandlerChain.handleCustomEndpoint submits a Runnable through
 * ModelManager.submitTask), after Netty has released the request, so a plugin can never read a
 * POST body (IllegalReferenceCountException). This executor takes the pool's place in
 * WorkLoadManager; while the request is still alive on the event loop it recognises the
 * Runnable that would run this plugin for an infer, reads the ChannelHandlerContext and the
 * request from it, and queues the job itself. Every other task goes to the pool unchanged, a
 * worker thread with its batches bounded first (BatchBudget).
 */
final class StockInference extends AbstractExecutorService {
    private final ExecutorService pool;

    private StockInference(ExecutorService pool) {
        this.pool = pool;
    }

    /** Puts the executor in front of WorkLoadManager's pool once ModelManager exists. */
    static synchronized boolean install() {
        ModelManager manager = ModelManager.getInstance();
        if (manager == null) {
            return false;
        }
        try {
            Field wlmField = ModelManager.class.getDeclaredField("wlm");
            wlmField.setAccessible(true);
            Object wlm = wlmField.get(manager);
            Field poolField = WorkLoadManager.class.getDeclaredField("threadPool");
            poolField.setAccessible(true);
            Object pool = poolField.get(wlm);
            if (!(pool instanceof StockInference)) {
                poolField.set(wlm, new StockInference((ExecutorService) pool));
            }
            return true;
        } catch (ReflectiveOperationException e) {
            throw new IllegalStateException("TorchServe 0.12's ModelManager.wlm / threadPool not found", e);
        }
    }

    /**
     * WorkLoadManager starts each worker thread with submit(thread): the thread gets the batch
     * budget (BatchBudget) before it runs.
     */
    @Override
    protected <T> RunnableFuture<T> newTaskFor(Runnable task, T value) {
        BatchBudget.install(task);
        return super.newTaskFor(task, value);
    }

    @Override
    public void execute(Runnable task) {
        if (task.getClass().getName().startsWith("org.pytorch.serve.http.HttpRequestHandlerChain$$Lambda")
                && infer(task)) {
            return;
        }
        pool.execute(task);
    }

    /** Queues the infer the task stands for; false when it is not an infer for this plugin. */
    private static boolean infer(Runnable task) {
        ChannelHandlerContext ctx = null;
        FullHttpRequest req = null;
        boolean ours = false;
        try {
            for (Field f : task.getClass().getDeclaredFields()) {
                f.setAccessible(true);
                Object v = f.get(task);
                if (v instanceof ChannelHandlerContext) {
                    ctx = (ChannelHandlerContext) v;
                } else if (v instanceof FullHttpRequest) {
                    req = (FullHttpRequest) v;
                } else if (v instanceof OpenInferenceEndpoint) {
                    ours = true;
                }
            }
        } catch (ReflectiveOperationException | RuntimeException e) {
            return false;
        }
        if (!ours || ctx == null || req == null || !HttpMethod.POST.equals(req.method())) {
            return false;
        }
        String[] p = OpenInferenceEndpoint.segments(req.uri());
        OpenInferenceEndpoint.Target t;
        try {
            t = OpenInferenceEndpoint.target(p);
        } catch (OpenInferenceEndpoint.Refusal e) {
            return false; // the plugin answers the error
        }
        if (!"infer".equals(t.action) && !"explain".equals(t.action)) {
            return false;
        }
        try {
            Model model = OpenInferenceEndpoint.model(t);
            RequestInput input = new RequestInput(NettyUtils.getRequestId(ctx.channel()));
            for (Map.Entry<String, String> h : req.headers().entries()) {
                input.updateHeaders(h.getKey(), h.getValue());
            }
            input.updateHeaders("explain", "explain".equals(t.action) ? "True" : "False");
            input.addParameter(
                    new InputParameter(
                            "body", NettyUtils.getBytes(req.content()), HttpUtil.getMimeType(req)));
            input.setClientExpireTS(model.getClientTimeoutInMills());
            IMetric total = MetricCache.getInstance().getMetricFrontend("ts_inference_requests_total");
            if (total != null) {
                total.addOrUpdate(
                        Arrays.asList(
                                t.name,
                                t.version == null ? "default" : t.version,
                                ConfigManager.getInstance().getHostName()),
                        1);
            }
            ApiUtils.addRESTInferenceJob(ctx, t.name, t.version, input);
        } catch (OpenInferenceEndpoint.Refusal e) {
            NettyUtils.sendJsonResponse(
                    ctx,
                    OpenInferenceEndpoint.field("error", e.getMessage()).toString(),
                    HttpResponseStatus.valueOf(e.status));
        } catch (Exception e) { // no worker / full queue (ServiceUnavailableException) and the like
            JsonObject body = OpenInferenceEndpoint.field("error", String.valueOf(e.getMessage()));
            int status = e instanceof org.pytorch.serve.http.ServiceUnavailableException ? 503 : 500;
            NettyUtils.sendJsonResponse(ctx, body.toString(), HttpResponseStatus.valueOf(status));
        }
        return true;
    }

    @Override
    public void shutdown() {
        pool.shutdown();
    }

    @Override
    public List<Runnable> shutdownNow() {
        return new ArrayList<>(pool.shutdownNow());
    }

    @Override
    public boolean isShutdown() {
        return pool.isShutdown();
    }

    @Override
    public boolean isTerminated() {
        return pool.isTerminated();
    }

    @Override
    public boolean awaitTermination(long timeout, TimeUnit unit) throws InterruptedException {
        return pool.awaitTermination(timeout, unit);
    }

}
